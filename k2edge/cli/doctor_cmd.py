"""``k2edge doctor``: what this machine offers k2edge."""

from __future__ import annotations

COMMAND = "doctor"
HELP = "report backends, TensorRT/CUDA/L4T versions, DLA cores, the jtop service and the video backends"
ORDER = 90

from .common import add_json, print_json


def register(p) -> None:
    add_json(p)


def run(args) -> int:
    from ..engine.probe import doctor_report
    from ..streams.probe import video_report

    r = {**doctor_report(), "video": video_report()}
    r["notes"] = ["no DLA here; the ONNX Runtime backend runs each device of a plan as a CPU lane"] * (r["dla_cores"] == 0)
    if args.json:
        print_json(r)
        return 0
    ort_info = r["backends"]["onnxruntime"]
    trt = r["backends"]["tensorrt"]["version"]
    print(f"onnxruntime  {ort_info['version'] or 'not installed'} ({', '.join(ort_info['providers'])})")
    print(f"tensorrt     {trt or 'not installed (on a Jetson: JetPack python3-libnvinfer; venv with --system-site-packages)'}")
    print(f"pycuda       {r['pycuda'] or 'not installed (pip install k2edge[jetson])'}")
    print(f"CUDA devices {', '.join(r['cuda_devices']) or 'none'}")
    print(f"CUDA         {r.get('cuda') or 'not found (/usr/local/cuda/version.json)'}")
    print(f"L4T          {r['l4t'] or 'not a Jetson'}" + (f" (JetPack {r['jetpack']})" if r.get("jetpack") else ""))
    trt_cores = r["backends"]["tensorrt"].get("dla_cores")
    print(f"board        {r['board'] or 'not a Jetson Orin'}; DLA cores: {r['dla_cores']}"
          + (f" (TensorRT sees {trt_cores})" if trt_cores is not None else ""))
    jt = r["jtop"]
    state = "running" if jt["socket"] else "not running"
    print(f"jtop service {state}" + (f" (systemd: {jt['systemd']})" if jt["systemd"] else "") + (f"; {jt['hint']}" if "hint" in jt else ""))
    av, gst = r["video"]["pyav"], r["video"]["gstreamer"]
    print(f"PyAV         {av['version'] or 'not installed (pip install k2edge[streams])'}"
          + (f" ({av['ffmpeg']}; H.264 decoder {'yes' if av['h264'] else 'no'})" if av["version"] else ""))
    if gst["gi"] is None:
        print("GStreamer    no gi (streams with backend = \"gstreamer\", csi:// and gst: need python3-gi; on a Jetson "
              "make the venv with --system-site-packages)")
    else:
        print(f"GStreamer    {gst['version'] or 'gi without GStreamer 1.0 (apt-get install gir1.2-gstreamer-1.0)'}")
        if gst["version"]:
            found = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in gst["elements"].items())
            print(f"NVDEC        {found}" + ("" if all(gst["elements"].values()) else " (a Jetson's JetPack has them)"))
    for note in r["notes"]:
        print(f"note: {note}")
    return 0
