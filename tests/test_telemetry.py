"""Telemetry sources on fake sysfs trees and test doubles, recorded traces, energy, and the thermal governor."""

from __future__ import annotations

import logging
import threading
import time
import types
from pathlib import Path

import pytest

from k2edge.telemetry import (
    GovernorState,
    Sample,
    SettingsError,
    TelemetryError,
    ThermalGovernor,
    ThermalSampler,
    ThermalSettings,
    open_source,
    thermal_sampler,
    validate_settings,
)
from k2edge.telemetry.jtop_source import START_HINT, JtopSource
from k2edge.telemetry.energy import energy_j, energy_per_inference, peak_temperature
from k2edge.telemetry.sysfs import SysfsSource
from k2edge.telemetry.trace import TraceSource, load_trace, write_trace

TRACES = Path(__file__).parent / "fixtures" / "traces"

# Fake sysfs trees laid out like the boards (Jetson Linux r36; rail names from NVIDIA's developer
# guide, "Jetson Orin Nano Series, Jetson Orin NX Series and Jetson AGX Orin Series").
ORIN_ZONES = ["cpu-thermal", "gpu-thermal", "cv0-thermal", "cv1-thermal", "cv2-thermal", "soc0-thermal", "soc1-thermal",
              "soc2-thermal", "tj-thermal"]
BOARDS = {
    "orin-agx": {
        "zones": ORIN_ZONES,
        "ina3221": {"1-0040": ["VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0"], "1-0041": ["NC", "VDDQ_VDD2_1V8AO", "NC"]},
    },
    "orin-nx": {"zones": ORIN_ZONES, "ina3221": {"1-0040": ["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"]}},
    "orin-nano": {"zones": ["cpu-thermal", "gpu-thermal", "soc0-thermal", "soc1-thermal", "soc2-thermal", "tj-thermal"],
                  "ina3221": {"1-0040": ["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"]}},
}
# (mV, mA) per rail
READINGS = {"VDD_GPU_SOC": (5000, 1200), "VDD_CPU_CV": (5000, 800), "VIN_SYS_5V0": (5000, 600), "VDDQ_VDD2_1V8AO": (5000, 300),
            "VDD_IN": (5080, 1900), "VDD_CPU_GPU_CV": (5080, 700), "VDD_SOC": (5080, 400)}


def make_board(root: Path, board: str, *, unreadable_zone: str | None = "cv1-thermal") -> Path:
    """A fake sysfs tree for ``board`` under ``root`` (temps 40.0 + zone index °C; one gated cv zone)."""
    spec = BOARDS[board]
    for i, kind in enumerate(spec["zones"]):
        z = root / "sys/class/thermal" / f"thermal_zone{i}"
        z.mkdir(parents=True)
        (z / "type").write_text(kind + "\n")
        # A power-gated cv zone answers EAGAIN on a real Orin; an empty read models it here.
        (z / "temp").write_text("" if kind == unreadable_zone else f"{40000 + 1000 * i}\n")
    (root / "sys/class/thermal/cooling_device0").mkdir()
    for n, (addr, labels) in enumerate(spec["ina3221"].items()):
        hw = root / "sys/bus/i2c/drivers/ina3221" / addr / "hwmon" / f"hwmon{n + 1}"
        hw.mkdir(parents=True)
        (hw / "name").write_text("ina3221\n")
        for ch, label in enumerate(labels, 1):
            (hw / f"in{ch}_label").write_text(label + "\n")
            mv, ma = READINGS.get(label, (0, 0))
            (hw / f"in{ch}_input").write_text(f"{mv}\n")
            (hw / f"curr{ch}_input").write_text(f"{ma}\n")
            (hw / f"curr{ch}_crit").write_text("32760\n")
        (hw / "in7_label").write_text("sum of shunt voltages\n")
        (hw / "in7_input").write_text("12\n")
        (hw / "curr7_input").write_text("3000\n")
    return root


def watts(label):
    mv, ma = READINGS[label]
    return mv * ma / 1e6


# sysfs ------------------------------------------------------------------------------------------------
def test_sysfs_agx_orin_zones_rails_and_summed_input(tmp_path):
    """AGX Orin: zones named like jtop, the gated cv zone skipped, NC and sum-of-shunt channels skipped, total = sum."""
    src = open_source("sysfs", root=make_board(tmp_path, "orin-agx"))
    s = src.sample()
    assert src.state == "ok" and src.message == ""
    assert set(s.temperatures_c) == {"cpu", "gpu", "cv0", "cv2", "soc0", "soc1", "soc2", "tj"}
    assert s.temperatures_c["tj"] == pytest.approx(48.0) and s.temperatures_c["cpu"] == pytest.approx(40.0)
    assert set(s.rails_w) == {"VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"}
    assert s.rails_w["VDD_GPU_SOC"] == pytest.approx(6.0)
    assert s.total_power_w == pytest.approx(sum(watts(r) for r in s.rails_w))
    assert s.hottest == ("tj", pytest.approx(48.0))


@pytest.mark.parametrize("board", ["orin-nx", "orin-nano"])
def test_sysfs_orin_nx_and_nano_use_vdd_in(tmp_path, board):
    """Orin NX / Nano: the input rail VDD_IN is the board's power; the other rails are parts of it."""
    s = SysfsSource(make_board(tmp_path, board)).sample()
    assert set(s.rails_w) == {"VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"}
    assert s.total_power_w == pytest.approx(watts("VDD_IN"))
    assert "tj" in s.temperatures_c and ("cv0" in s.temperatures_c) == (board == "orin-nx")


def test_sysfs_reads_live_values_and_survives_a_vanishing_zone(tmp_path):
    """Each sample re-reads the files; a zone that disappears is skipped, an offline -256 °C reading dropped."""
    root = make_board(tmp_path, "orin-nx")
    src = SysfsSource(root)
    (root / "sys/class/thermal/thermal_zone8/temp").write_text("81500\n")
    (root / "sys/class/thermal/thermal_zone0/temp").write_text("-256000\n")
    (root / "sys/class/thermal/thermal_zone1/temp").unlink()
    s = src.sample()
    assert s.temperatures_c["tj"] == 81.5 and "cpu" not in s.temperatures_c and "gpu" not in s.temperatures_c
    assert src.state == "ok"


def test_sysfs_hwmon_class_path_is_found_too(tmp_path):
    """An INA3221 reachable only as /sys/class/hwmon/hwmonN (name ina3221) is found."""
    hw = tmp_path / "sys/class/hwmon/hwmon0"
    hw.mkdir(parents=True)
    (hw / "name").write_text("ina3221\n")
    for name, value in {"in1_label": "VDD_IN", "in1_input": "5000", "curr1_input": "2000"}.items():
        (hw / name).write_text(value)
    s = SysfsSource(tmp_path).sample()
    assert s.rails_w == {"VDD_IN": 10.0} and s.total_power_w == 10.0 and s.temperatures_c == {}


def test_sysfs_without_sensors_is_unknown_not_an_error(tmp_path):
    """No zones and no rails: state unknown with the paths looked at; sampling still works."""
    src = open_source("sysfs", root=tmp_path)
    assert src.state == "unknown" and "thermal zone" in src.message and str(tmp_path) in src.message
    s = src.sample()
    assert (s.temperatures_c, s.rails_w, s.total_power_w) == ({}, {}, None)


def test_auto_picks_sysfs_on_a_jetson_tree_and_unknown_on_nothing(tmp_path):
    """auto: INA3221 rails -> sysfs; nothing at all -> a source whose state is unknown, naming what was tried."""
    assert open_source("auto", root=make_board(tmp_path / "agx", "orin-agx")).kind == "sysfs"
    empty = open_source("auto", root=tmp_path / "empty")
    assert empty.state == "unknown" and "no telemetry source found" in empty.message
    with pytest.raises(TelemetryError, match="must be one of"):
        open_source("tegrastats")


# jtop (test double of the jtop module; the real one needs a Jetson) ------------------------------------
class JtopException(Exception):
    pass


def fake_jtop_module(running: bool = True):
    class jtop:  # noqa: N801 - mirrors jetson-stats' class name
        def __init__(self, interval=0.5):
            self.interval, self.closed = interval, False

        def start(self):
            if not running:
                raise JtopException("The jtop.service is not active. Please run:\nsudo systemctl restart jtop.service")

        temperature = {"cpu": {"temp": 45.5, "online": True}, "tj": {"temp": 47.25, "online": True},
                       "cv0": {"temp": -256.0, "online": False}}
        power = {"rail": {"VDD_CPU_GPU_CV": {"volt": 5080, "curr": 700, "power": 3556, "avg": 3500},
                          "VDD_SOC": {"volt": 5080, "curr": 400, "power": 2032, "avg": 2000}},
                 "tot": {"volt": 5080, "curr": 1900, "power": 9652, "avg": 9600, "name": "VDD_IN"}}

        def close(self):
            self.closed = True

    return types.SimpleNamespace(jtop=jtop, JtopException=JtopException)


def test_jtop_source_reads_temperatures_and_rails_in_watts():
    """jtop 4.x dicts: online temperatures in °C, rails mW -> W, the total (VDD_IN) kept as a rail too."""
    src = open_source("jtop", jtop_module=fake_jtop_module())
    s = src.sample()
    assert src.state == "ok"
    assert s.temperatures_c == {"cpu": 45.5, "tj": 47.25}
    assert s.rails_w == {"VDD_CPU_GPU_CV": 3.556, "VDD_SOC": 2.032, "VDD_IN": 9.652}
    assert s.total_power_w == pytest.approx(9.652)
    src.close()


def test_jtop_service_not_running_is_unknown_with_the_fix():
    """Service down: state unknown, the message says how to start jtop.service."""
    src = open_source("jtop", jtop_module=fake_jtop_module(running=False))
    assert src.state == "unknown"
    assert src.message.startswith("jtop.service is not running: sudo systemctl enable --now jtop.service")
    assert src.sample().temperatures_c == {}


def test_jtop_started_after_the_daemon_or_lost_is_connected_again():
    """jtop.service down at start, then started: the source connects again after its backoff (it used to stay
    unknown until the daemon restarted); a service lost while reading is closed and connected again too."""
    service = {"up": False, "starts": 0}
    module = fake_jtop_module()
    original = module.jtop

    class jtop(original):  # noqa: N801 - the test double of jetson-stats' class, whose service comes and goes
        def start(self):
            service["starts"] += 1
            if not service["up"]:
                raise JtopException("The jtop.service is not active. Please run:\nsudo systemctl restart jtop.service")

        @property
        def temperature(self):
            if not service["up"]:
                raise ConnectionResetError("jtop.service went away")
            return original.temperature

    module.jtop = jtop
    now = [0.0]
    src = open_source("jtop", jtop_module=module, clock=lambda: now[0])
    assert src.state == "unknown" and START_HINT in src.message and service["starts"] == 1
    service["up"] = True
    assert src.sample().temperatures_c == {} and service["starts"] == 1  # within the backoff: no new try
    now[0] += JtopSource.RETRY_S[0] * 2  # past the first delay (at most twice the first)
    assert src.sample().temperatures_c == {"cpu": 45.5, "tj": 47.25} and src.state == "ok"
    service["up"] = False
    assert src.sample().temperatures_c == {} and src.state == "unknown" and "jtop lost jtop.service" in src.message
    service["up"] = True
    assert src.sample().temperatures_c == {}  # waits its backoff again
    now[0] += JtopSource.RETRY_S[0] * 2
    assert src.sample().temperatures_c and src.state == "ok" and service["starts"] == 3
    src.close()


def test_jtop_not_installed_is_unknown(monkeypatch):
    """No jetson-stats: unknown, with what to install."""
    monkeypatch.setitem(__import__("sys").modules, "jtop", None)
    src = open_source("jtop")
    assert src.state == "unknown" and "pip install jetson-stats" in src.message


def test_auto_prefers_jtop_when_its_socket_answers(tmp_path):
    """auto with /run/jtop.sock and a working service: jtop; with the service down: falls back to sysfs."""
    root = make_board(tmp_path, "orin-nx")
    (root / "run").mkdir()
    (root / "run/jtop.sock").touch()
    assert open_source("auto", root=root, jtop_module=fake_jtop_module()).kind == "jtop"
    assert open_source("auto", root=root, jtop_module=fake_jtop_module(running=False)).kind == "sysfs"


# NVML (test double of pynvml) ------------------------------------------------------------------------
def fake_pynvml():
    return types.SimpleNamespace(
        NVML_TEMPERATURE_GPU=0, nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetTemperature=lambda h, kind: 60 + h,
        nvmlDeviceGetPowerUsage=lambda h: 250_000 + 1000 * h)


def test_nvml_source_and_missing_nvml(monkeypatch):
    """NVML: one temperature and one power rail per GPU, summed; without pynvml: unknown."""
    s = open_source("nvml", pynvml_module=fake_pynvml()).sample()
    assert s.temperatures_c == {"gpu0": 60.0, "gpu1": 61.0} and s.total_power_w == pytest.approx(501.0)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)
    src = open_source("nvml")
    assert src.state == "unknown" and "nvidia-ml-py" in src.message


# traces ------------------------------------------------------------------------------------------------
def test_traces_load_in_both_formats():
    """JSONL and CSV traces load with temperatures, rails and the input-rail total."""
    heating = load_trace(TRACES / "heating.jsonl")
    noisy = load_trace(TRACES / "noisy_soft_limit.csv")
    assert len(heating) == 241 and heating[0].total_power_w == pytest.approx(7.998)
    assert len(noisy) == 601 and set(noisy[0].temperatures_c) == {"cpu", "gpu", "tj"}
    assert noisy[0].total_power_w == noisy[0].rails_w["VDD_IN"]


@pytest.mark.parametrize("name,text,fragment", [
    ("bad.jsonl", '{"t": 0, "temperatures_c": {"tj": 50}}\n{"t": "x"}\n', "bad.jsonl:2: t: expected a number"),
    ("back.jsonl", '{"t": 5}\n{"t": 4}\n', "back.jsonl:2: t goes backwards"),
    ("keys.jsonl", '{"t": 0, "temp": 50}\n', "unknown key(s) ['temp']"),
    ("cols.csv", "t,tj\n0,50\n", "unknown column(s) ['tj']"),
    ("empty.csv", "t,temp.tj\n", "holds no samples"),
    ("trace.txt", "t\n", "expected a .jsonl or .csv"),
])
def test_malformed_traces_name_the_file_and_line(tmp_path, name, text, fragment):
    """A bad trace fails with one message naming where."""
    (tmp_path / name).write_text(text)
    with pytest.raises(TelemetryError) as e:
        load_trace(tmp_path / name)
    assert fragment in str(e.value)


def test_trace_source_steps_repeats_loops_and_replays_in_real_time(tmp_path):
    """Step mode returns rows in order then holds the last; loop keeps time increasing; realtime follows the clock."""
    path = write_trace([Sample(float(t), {"tj": 50.0 + t}, {}, None) for t in range(3)], tmp_path / "t.jsonl")
    src = TraceSource(path)
    assert [src.sample().t for _ in range(5)] == [0.0, 1.0, 2.0, 2.0, 2.0] and src.exhausted
    looped = TraceSource(path, loop=True)
    assert [looped.sample().t for _ in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    now = [100.0]
    rt = TraceSource(path, realtime=True, clock=lambda: now[0])
    assert rt.sample().temperatures_c["tj"] == 50.0
    now[0] = 101.5
    assert rt.sample().temperatures_c["tj"] == 51.0
    now[0] = 150.0
    assert rt.sample().temperatures_c["tj"] == 52.0


# energy ------------------------------------------------------------------------------------------------
def test_energy_per_inference_integrates_the_input_rail():
    """Constant 10 W for 2 s over 4 inferences is 5 J each; a ramp integrates by trapezoid."""
    flat = [Sample(t / 10, {}, {}, 10.0) for t in range(0, 31)]
    assert energy_per_inference(flat, 0.5, 2.5, 4) == pytest.approx(5.0)
    ramp = [Sample(0.0, {}, {}, 0.0), Sample(1.0, {}, {}, 10.0), Sample(2.0, {}, {}, 10.0)]
    assert energy_j(ramp, 0.0, 2.0) == pytest.approx(15.0)
    assert energy_j(ramp, 0.5, 1.5) == pytest.approx(3.75 + 5.0)  # 5->10 W over 0.5 s, then 10 W
    assert energy_per_inference(ramp, 1.2, 1.3, 1) == pytest.approx(1.0)  # shorter than the sampling period


def test_energy_is_none_without_power_or_work():
    """No power rail, an empty window or no inference -> None, not zero."""
    temps_only = [Sample(t, {"tj": 50.0}, {}, None) for t in range(3)]
    assert energy_per_inference(temps_only, 0, 2, 10) is None
    powered = [Sample(t, {}, {}, 5.0) for t in range(3)]
    assert energy_per_inference(powered, 1, 1, 10) is None and energy_per_inference(powered, 0, 2, 0) is None


def test_energy_and_peak_from_a_recorded_trace():
    """On the heating trace: energy over the first minute from VDD_IN, and the peak tj."""
    samples = load_trace(TRACES / "heating.jsonl")
    expected = sum((b.t - a.t) * (a.total_power_w + b.total_power_w) / 2 for a, b in zip(samples[:60], samples[1:61]))
    assert energy_per_inference(samples, 0.0, 60.0, 600) == pytest.approx(expected / 600)
    name, peak = peak_temperature(samples)
    assert name == "tj" and 98.5 < peak < 99.5


# governor ---------------------------------------------------------------------------------------------
def run_trace(name: str, settings: ThermalSettings | None = None) -> ThermalGovernor:
    g = ThermalGovernor(settings)
    for s in load_trace(TRACES / name):
        g.update(s)
    return g


def test_heating_trace_walks_every_state_up_and_down():
    """Heating past soft/hard/critical and cooling: each limit crossed once each way, down only past the hysteresis."""
    g = run_trace("heating.jsonl")
    path = [(t.from_state, t.to_state) for t in g.transitions]
    assert path == [("unknown", "normal"), ("normal", "warm"), ("warm", "hot"), ("hot", "critical"),
                    ("critical", "hot"), ("hot", "warm"), ("warm", "normal")]
    up = {t.to_state: t for t in g.transitions[1:4]}
    assert up["warm"].temperature_c >= 75 and up["hot"].temperature_c >= 85 and up["critical"].temperature_c >= 95
    down = g.transitions[4:]
    assert down[0].temperature_c < 92 and down[1].temperature_c < 82 and down[2].temperature_c < 72
    assert "critical_c 95 - hysteresis 3" in down[0].reason


def test_noisy_sensor_at_the_soft_limit_does_not_flap():
    """±2 °C noise and one-sample spikes around 75 °C: one step into warm and no more; without filter and hysteresis it flaps."""
    g = run_trace("noisy_soft_limit.csv")
    assert [(t.from_state, t.to_state) for t in g.transitions] == [("unknown", "normal"), ("normal", "warm")]
    assert g.state == "warm"
    naive = run_trace("noisy_soft_limit.csv", ThermalSettings(hysteresis_c=0, filter_samples=1))
    assert naive.transition_count > 50  # the trace really is noisy enough to flap


def test_steady_trace_stays_normal():
    """A steady 52 °C load stays normal after the first reading."""
    g = run_trace("steady.jsonl")
    assert g.transition_count == 1 and g.state == "normal" and "below soft_c" in g.current.reason


def test_missing_sensor_is_unknown_not_a_crash():
    """Thermal zones vanishing mid-trace: unknown (after the filter's window), then back to normal when they return."""
    g = run_trace("missing_sensor.jsonl")
    assert [(t.from_state, t.to_state) for t in g.transitions] == [("unknown", "normal"), ("normal", "unknown"),
                                                                  ("unknown", "normal")]
    assert "no temperature reading" in g.transitions[1].reason
    assert 30 <= g.transitions[1].t <= 33 and g.transitions[2].t == 50


def test_a_watched_sensor_missing_and_a_source_that_cannot_read():
    """sensors=['tj'] without tj -> unknown naming it; a None sample with the source's message -> unknown with it."""
    g = ThermalGovernor(ThermalSettings(sensors=["tj"], filter_samples=1))
    st = g.update(Sample(0.0, {"cpu": 99.0}))
    assert st.state == "unknown" and "tj missing" in st.reason
    g2 = ThermalGovernor(ThermalSettings(filter_samples=1))
    st2 = g2.update(None, "jtop.service is not running: sudo systemctl enable --now jtop.service")
    assert st2.state == "unknown" and "jtop.service" in st2.reason and not st2.changed


def test_power_budget_holds_warm_until_the_average_falls_below_it():
    """Average input power over the window above the budget -> warm; it clears only below budget - hysteresis."""
    g = ThermalGovernor(ThermalSettings(power_budget_w=10.0, power_window_s=4.0, power_hysteresis_w=1.0, filter_samples=1))
    states = [g.update(Sample(float(t), {"tj": 50.0}, {}, p)).state for t, p in enumerate([8, 8, 14, 14, 14, 9.5, 9.5, 9.5, 8, 8, 8, 8])]
    assert states[:2] == ["normal", "normal"] and "warm" in states[3:5]
    assert states[-1] == "normal"
    warm = next(t for t in g.transitions if t.to_state == "warm")
    assert "power_budget_w 10 W" in warm.reason
    hot = ThermalGovernor(ThermalSettings(power_budget_w=10.0, power_state="hot", filter_samples=1))
    assert hot.update(Sample(0.0, {"tj": 50.0}, {}, 20.0)).state == "hot"


def test_power_readings_that_stop_age_out_of_the_window():
    """A power rail that stops answering (or a source lost altogether) is not judged on its last average for
    ever: the readings leave the window, and the state follows the temperature (or goes unknown)."""
    g = ThermalGovernor(ThermalSettings(power_budget_w=10.0, power_window_s=10.0, filter_samples=3))
    t = 0.0
    for _ in range(20):  # 10 s at 15 W, cool
        t += 0.5
        st = g.update(Sample(t, {"gpu": 50.0}, {"VDD_IN": 15.0}, 15.0))
    assert st.state == "warm" and st.power_avg_w == pytest.approx(15.0)
    states = []
    for _ in range(40):  # 20 s with temperatures and no power reading
        t += 0.5
        states.append(g.update(Sample(t, {"gpu": 50.0}, {}, None)))
    assert states[0].state == "warm" and states[-1].state == "normal" and states[-1].power_avg_w is None
    assert "below soft_c" in states[-1].reason
    again = ThermalGovernor(ThermalSettings(power_budget_w=10.0, power_window_s=10.0, filter_samples=3))
    for i in range(4):
        again.update(Sample(0.5 * i, {"gpu": 50.0}, {}, 15.0))
    lost = [again.update(None, "jtop lost jtop.service") for _ in range(3)]
    assert lost[-1].state == "unknown" and "jtop lost" in lost[-1].reason and lost[-1].power_avg_w is None


def test_transitions_are_logged_and_kept_for_telemetry(caplog):
    """Hotter transitions log at WARNING, cooler at INFO; the snapshot carries the last transitions."""
    caplog.set_level(logging.INFO, logger="k2edge.telemetry.governor")
    g = ThermalGovernor(ThermalSettings(filter_samples=1))
    for t, c in enumerate([50, 80, 50]):
        g.update(Sample(float(t), {"tj": float(c)}))
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert levels[1][0] == "WARNING" and "normal -> warm" in levels[1][1] and "80.0 °C >= soft_c 75" in levels[1][1]
    assert levels[2][0] == "INFO" and "warm -> normal" in levels[2][1]
    snap = g.snapshot()
    assert snap["state"] == "normal" and snap["transition_count"] == 3 and snap["transitions"][-1]["to_state"] == "normal"


def test_governor_state_says_what_to_do():
    """warm/hot prefer the DLA-heavier profile; critical refuses local work."""
    assert GovernorState("warm", True, "").prefer_dla and GovernorState("hot", True, "").prefer_dla
    assert not GovernorState("normal", False, "").prefer_dla
    assert GovernorState("critical", True, "").refuses_local_work


def test_sampler_thread_feeds_the_governor_from_a_trace():
    """The sampler polls a trace on its own thread: state readable meanwhile, on_transition called per change."""
    seen: list[str] = []
    sampler = thermal_sampler(ThermalSettings(source="trace", trace=TRACES / "heating.jsonl"),
                              on_transition=lambda st: seen.append(st.state))
    sampler.interval_s = 0.001
    with sampler:
        deadline = time.monotonic() + 60
        while sampler.state.state != "critical" and time.monotonic() < deadline:
            time.sleep(0.005)
    assert sampler.state.state in ("critical", "hot", "warm", "normal")
    assert seen[:4] == ["normal", "warm", "hot", "critical"]
    snap = sampler.snapshot()
    assert snap["source"]["kind"] == "trace" and snap["sample"]["temperatures_c"]
    window = sampler.samples_between(0.0, 10.0)
    assert window and all(s.t <= 10.0 + sampler.interval_s for s in window)


def test_sampler_survives_a_failing_source():
    """A source that raises on read does not kill the thread; the state goes unknown with the reason."""
    class Broken(SysfsSource):
        def _read(self):
            raise OSError("EAGAIN")

    sampler = ThermalSampler(Broken("/nonexistent"), ThermalGovernor(ThermalSettings(filter_samples=1)), interval_s=0.001)
    with sampler:
        deadline = time.monotonic() + 60
        while "EAGAIN" not in sampler.state.reason and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sampler._thread.is_alive()  # the read failed and the thread goes on
    assert sampler.state.state == "unknown" and "EAGAIN" in sampler.state.reason
    assert isinstance(threading.active_count(), int)


def test_sampler_on_a_source_without_its_service_reports_why():
    """jtop without its service: the governor's unknown reason carries the source's fix."""
    sampler = ThermalSampler(open_source("jtop", jtop_module=fake_jtop_module(running=False)),
                             ThermalGovernor(ThermalSettings(filter_samples=1)))
    st = sampler.poll()
    assert st.state == "unknown" and "sudo systemctl enable --now jtop.service" in st.reason


def test_thermal_settings_validate_with_field_paths():
    """Limits out of order, unknown keys and a trace source without a file name the field."""
    with pytest.raises(SettingsError) as e:
        validate_settings(ThermalSettings, {"soft_c": 80, "hard_c": 70, "bogus": 1}, "thermal")
    msg = str(e.value)
    assert "thermal.hard_c: must be above soft_c (80.0), got 70.0" in msg and "thermal.bogus: unknown key" in msg
    with pytest.raises(SettingsError, match=r"thermal\.trace: source 'trace' needs trace"):
        validate_settings(ThermalSettings, {"source": "trace"}, "thermal")
    with pytest.raises(SettingsError, match=r"thermal\.hysteresis_c: must be below hard_c - soft_c"):
        validate_settings(ThermalSettings, {"hysteresis_c": 15}, "thermal")
    ok = validate_settings(ThermalSettings, {"source": "sysfs", "power_budget_w": 15}, "thermal")
    assert ok.soft_c == 75 and ok.power_budget_w == 15
