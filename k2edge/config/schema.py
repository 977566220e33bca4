"""The daemon config schema.

Relative paths in the file are resolved against the file's directory. Secrets never live in the
TOML: the MQTT password comes from a file or a systemd credential (``LoadCredential=``), read at
start and kept out of every log, status message and repr.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from ..errors import K2EdgeError
from ..readfile import MAX_SECRET_BYTES, read_small
from ..profile.validation import describe_validation_error, model_keys
from .card import CardError, ModelCard, card_from_dict
from .cloud import CloudSettings, EscalationSettings
from .deploy import DeploySettings, TrustSettings
from .streams import StorageSettings, StreamConfig
from .tables import Strict as _Strict, topic_level as _topic_level, topic_prefix_problem
from .thermal import ThermalSettings
from .tracing import TracingSettings

DEFAULT_PATH = Path("/etc/k2edge/k2edge.toml")


class ConfigError(K2EdgeError):
    """The daemon config is missing, not TOML, or invalid (the message names the key)."""


def host_problem(host: str) -> str | None:
    """Why ``host`` cannot be a broker's host name or address (never repeating it: it may hold a password), or None."""
    if not host:
        return "is empty"
    if "@" in host or "/" in host:
        return "must be a host name or address, not a URL or user:password@host"
    if any(c.isspace() or not c.isprintable() for c in host):
        return "holds spaces or control characters"
    return None


class MqttConfig(_Strict):
    """Broker connection. Password from ``password_file`` or ``password_credential`` only."""

    host: str = "127.0.0.1"
    port: int = Field(1883, ge=1, le=65535)
    client_id: str | None = Field(None, description="stable id for the persistent session; default k2edge-{device_id}")
    topic_prefix: str | None = Field(None, description="default k2edge/{device_id}")
    keepalive_s: int = Field(30, ge=5, le=3600)
    session_expiry_s: int = Field(86400, ge=1, description="how long the broker keeps queued requests while we are down")
    qos: int = Field(1, ge=0, le=1, description="QoS of the request subscriptions (1: nothing lost while the daemon is down)")
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    username: str | None = None
    password_file: Path | None = None
    password_credential: str | None = Field(None, description="name of a systemd credential ($CREDENTIALS_DIRECTORY/NAME)")
    reconnect_min_s: float = Field(0.5, gt=0)
    reconnect_max_s: float = Field(30.0, gt=0)
    max_inflight: int = Field(64, ge=1, le=65535, description="answers at QoS 1 that may await the broker's "
                              "acknowledgement at once (fewer when the broker's receive maximum is lower); each may "
                              "be delivered twice after a broker restart, as QoS 1 allows")

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        problem = host_problem(v)
        if problem and "@" in v:
            problem += " (the user goes in mqtt.username, the password in mqtt.password_file or mqtt.password_credential)"
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("topic_prefix")
    @classmethod
    def _prefix(cls, v: str | None) -> str | None:
        if v is not None and (problem := topic_prefix_problem(v)):
            raise ValueError(f"{problem}, got {v[:80]!r}")
        return v

    @model_validator(mode="after")
    def _pairs(self):
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.password_file and self.password_credential:
            raise ValueError("give password_file or password_credential, not both")
        if (self.password_file or self.password_credential) and not self.username:
            raise ValueError("a password needs a username")
        if self.reconnect_min_s > self.reconnect_max_s:
            raise ValueError("reconnect_min_s must not exceed reconnect_max_s")
        return self


class ModelConfig(_Strict):
    """One served model: a bare ``onnx`` file, or a signed ``bundle`` (exactly one of them)."""

    name: str
    onnx: Path | None = Field(None, description="the ONNX model (unsigned: with [trust], only when allow_unsigned)")
    bundle: Path | None = Field(None, description="a signed bundle (.k2b): the model's first version; later ones "
                                                  "are deployed over the air into the state directory")
    profile: str = "cpu-dev"
    labels: Path | None = None
    calib: Path | None = None
    check: Path | None = Field(None, description="the INT8 check's set (ImageFolder, .npz, or a detector's COCO .json), "
                                                 "judged instead of the calibration set's held-out fifth")
    backend: str = Field("auto", pattern="^(auto|onnxruntime|tensorrt)$")
    top_k: int = Field(5, ge=1, le=1000)
    card: Path | ModelCard | None = Field(
        None, description="a card file (replaces the card found beside the model), or a card table whose keys "
                          "override that card's; labels above override both")
    escalation: EscalationSettings = Field(default_factory=EscalationSettings,
                                           description="when this model's requests go to the cloud")

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        return _topic_level(v, "model name")

    @field_validator("card", mode="before")
    @classmethod
    def _card(cls, v):
        if isinstance(v, dict):
            try:
                return card_from_dict(v, "card table")
            except CardError as exc:
                raise ValueError(str(exc).removeprefix("card table: ")) from None
        if v is not None and not isinstance(v, (str, Path, ModelCard)):
            raise ValueError(f"must be a card file path or a card table, got {v!r}")
        return v

    @model_validator(mode="after")
    def _source(self):
        if (self.onnx is None) == (self.bundle is None):
            raise ValueError("give exactly one of onnx (a model file) or bundle (a signed .k2b)")
        if self.bundle is not None:
            given = sorted(k for k in ("labels", "calib") if getattr(self, k) is not None)
            if isinstance(self.card, Path):
                given.append("card (a file)")
            if given:
                raise ValueError(f"{', '.join(given)}: a bundle brings its own; a [models.card] table may still "
                                 "override card keys")
        return self

    @property
    def profile_set(self) -> bool:
        """True when the config names a profile (which then wins over a bundle's)."""
        return "profile" in self.model_fields_set

    def card_args(self) -> dict:
        """``Engine.build`` keywords for this model's card: a file replaces the card found beside the
        model; a table's keys override it."""
        if isinstance(self.card, ModelCard):
            return {"card_overrides": self.card}
        return {"card": self.card} if self.card is not None else {}


class ServiceConfig(_Strict):
    """Scheduling and limits."""

    queue_size: int = Field(
        64, ge=1, le=65535,
        description="requests held waiting in the daemon; beyond it the daemon stops reading and the broker keeps the "
                    "rest (also the MQTT Receive Maximum asked of the broker); busy only past twice this plus 64")
    max_batch: int = Field(8, ge=1, le=256)
    batch_timeout_ms: float = Field(
        0.0, ge=0, le=10000,
        description="0: a batch goes as soon as the engine has room (adaptive); >0: hold it this long for companions")
    max_payload_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    max_image_pixels: int = Field(16_777_216, ge=1, description="images with more pixels are refused from their header, "
                                                                "before decoding (default 4096 x 4096)")
    max_answer_bytes: int = Field(1024 * 1024, ge=1024,
                                  description="an answer larger than this (task = \"tensor\" outputs) is refused with payload_too_large")
    staging_threads: int = Field(1, ge=1, le=64, description="threads decoding a batch's images; 1: the model's batcher decodes them")
    threads_per_lane: int = Field(
        0, ge=0, le=256,
        description="ONNX Runtime intra-op threads of each CPU lane's session; 0 or \"auto\": chosen from the cores the "
                    "daemon may run on (its CPU affinity): a one-device profile runs one single-threaded lane per core "
                    "on one engine, a profile naming several devices one lane per device sharing the cores. TensorRT "
                    "engines ignore it")

    @field_validator("threads_per_lane", mode="before")
    @classmethod
    def _auto_threads(cls, v):
        return 0 if v == "auto" else v

    telemetry_interval_s: float = Field(5.0, gt=0)
    default_deadline_ms: float | None = Field(None, ge=1, le=3_600_000, description="deadline for requests that give none")
    drain_timeout_s: float = Field(30.0, gt=0)
    cache_dir: Path | None = Field(None, description="engine cache; default $CACHE_DIRECTORY or ~/.cache/k2edge")
    state_dir: Path | None = Field(None, description="answers, outbox and state; default $STATE_DIRECTORY or ~/.local/state/k2edge")


class MetricsSettings(_Strict):
    """The Prometheus endpoint (``/metrics``); present means on."""

    port: int = Field(9108, ge=0, le=65535, description="0: any free port (tests)")
    host: str = Field("127.0.0.1", min_length=1, description="address to bind; 0.0.0.0 exposes it to the network")


_LOOPBACK = ("localhost", "::1")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    return host in _LOOPBACK or host.startswith("127.")


class HttpSettings(_Strict):
    """The local web app (``[http]``): the live view, its API, and ``/metrics``; present means on."""

    port: int = Field(8080, ge=0, le=65535, description="0: any free port (tests)")
    host: str = Field("127.0.0.1", min_length=1, description="address to bind; any but loopback needs token_file or "
                      "password_file")
    token_file: Path | None = Field(None, description="a bearer token (Authorization: Bearer, or ?token= once in a "
                                    "browser); never logged")
    password_file: Path | None = Field(None, description="an HTTP Basic password (any user name); never logged")

    @model_validator(mode="after")
    def _guarded(self):
        if not is_loopback(self.host) and self.token_file is None and self.password_file is None:
            raise ValueError(f"host {self.host!r} exposes the live view beyond this machine: give token_file or "
                             "password_file (or keep host = \"127.0.0.1\")")
        return self


class FleetConfig(_Strict):
    group: str | None = Field(None, description="shared-subscription group: also take work from $share/{group}/k2edge/pool/infer/{model}")

    @field_validator("group")
    @classmethod
    def _group(cls, v):
        return v if v is None else _topic_level(v, "fleet.group")


class DaemonConfig(_Strict):
    """The whole file."""

    device_id: str = Field(default_factory=lambda: socket.gethostname().split(".")[0])
    board: str | None = Field(None, description="orin-agx | orin-nx-16 | orin-nx-8 | orin-nano; default: detected, else "
                                                "orin-agx")
    mqtt: MqttConfig = Field(default_factory=MqttConfig)
    service: ServiceConfig = Field(default_factory=ServiceConfig)
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    thermal: ThermalSettings = Field(default_factory=ThermalSettings)
    cloud: CloudSettings | None = Field(None, description="the K2 server; without it nothing is escalated")
    trust: TrustSettings | None = Field(None, description="signed model bundles: the trusted keys")
    deploy: DeploySettings = Field(default_factory=DeploySettings)
    metrics: MetricsSettings | None = Field(None, description="the Prometheus /metrics endpoint; without it none")
    http: HttpSettings | None = Field(None, description="the local web app (live view, API, /metrics); without it none")
    tracing: TracingSettings | None = Field(None, description="OpenTelemetry traces over OTLP/HTTP; without it none")
    models: tuple[ModelConfig, ...]
    streams: tuple[StreamConfig, ...] = Field((), description="video sources processed by a served detection model; "
                                                                "read at start (a change takes effect at the next start)")
    storage: StorageSettings = Field(default_factory=StorageSettings)
    _source: Path | None = PrivateAttr(None)  # not a key of the file: load_config records where it read it

    @field_validator("board")
    @classmethod
    def _board(cls, v):
        from ..dla.boards import BOARDS

        if v is not None and v not in BOARDS:
            raise ValueError(f"must be one of {', '.join(repr(b) for b in BOARDS)}, got {v!r}")
        return v

    @field_validator("device_id")
    @classmethod
    def _device(cls, v):
        return _topic_level(v, "device_id")

    @field_validator("models")
    @classmethod
    def _models(cls, v, info: ValidationInfo):
        if not v:
            raise ValueError("at least one [[models]] entry is needed")
        names = [m.name for m in v]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"model names must be unique, repeated: {sorted(dup)}")
        bundled = [m.name for m in v if m.bundle is not None]
        if bundled and "trust" in info.data and info.data["trust"] is None:  # (a [trust] that failed is reported already)
            raise ValueError(f"model {bundled[0]!r} names a bundle, which is loaded only with a [trust] table "
                             "naming the keys that sign it (or allow_unsigned = true)")
        return v

    @model_validator(mode="after")
    def _streams(self):
        names = [s.name for s in self.streams]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"streams: stream names must be unique, repeated: {dup}")
        served = {m.name for m in self.models}
        for i, s in enumerate(self.streams):
            if s.model not in served:
                raise ValueError(f"streams.{i}.model: {s.model!r} is not a model served here (stream {s.name!r}); "
                                 f"served: {sorted(served)}")
            if s.escalation and self.cloud is None:
                raise ValueError(f"streams.{i}.escalation: rules need a [cloud] table (the K2 server to ask)")
        return self

    @property
    def source(self) -> Path | None:
        """The file this config was read from; None for one built in code."""
        return self._source

    @property
    def where(self) -> str:
        """The config as a message names it: its file, else "config"."""
        return str(self._source) if self._source is not None else "config"

    @property
    def client_id(self) -> str:
        return self.mqtt.client_id or f"k2edge-{self.device_id}"

    @property
    def prefix(self) -> str:
        return self.mqtt.topic_prefix or f"k2edge/{self.device_id}"

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


def _resolve(data: dict, base: Path) -> dict:
    """Make relative paths in the file relative to the file's directory."""
    def fix(section, keys):  # a table given as something else is left to the validation, which names it
        for k in keys if isinstance(section, dict) else ():
            if isinstance(section.get(k), str) and section[k] and not os.path.isabs(section[k]):
                section[k] = str(base / section[k])

    fix(data.get("mqtt"), ("tls_ca_file", "tls_cert_file", "tls_key_file", "password_file"))
    fix(data.get("service"), ("cache_dir", "state_dir"))
    fix(data.get("http"), ("token_file", "password_file"))
    fix(data.get("cloud"), ("api_key_file", "outbox_path"))
    fix(data.get("thermal"), ("trace", "sysfs_root"))
    fix(data.get("deploy"), ("ca_file",))
    trust = data.get("trust")
    if isinstance(trust, dict) and isinstance(trust.get("keys"), list):
        trust["keys"] = [str(base / k) if isinstance(k, str) and k and not os.path.isabs(k) else k for k in trust["keys"]]
    for st in data.get("streams", []) if isinstance(data.get("streams"), list) else []:
        if isinstance(st, dict):
            fix(st, ("password_file",))
    for m in data.get("models", []) if isinstance(data.get("models"), list) else []:
        if isinstance(m, dict):
            fix(m, ("onnx", "bundle", "labels", "calib", "check", "card"))
            if isinstance(m.get("card"), dict):
                fix(m["card"], ("labels",))
            for holder, key in ((m, "profile"), (m.get("escalation") if isinstance(m.get("escalation"), dict) else {}, "warm_profile")):
                prof = holder.get(key)
                if isinstance(prof, str) and (prof.endswith(".json") or "/" in prof) and not os.path.isabs(prof):
                    holder[key] = str(base / prof)
    return data


def read_config(path: Path, error: type[Exception] = ConfigError) -> dict:
    """The config file's tables as read, before validation, with its relative paths made relative to
    the file's folder (as :func:`load_config` sees them): for a command that needs one table of it.

    Raises:
        ``error``: missing file or TOML syntax error (with line).
    """
    from .toml import read_toml

    data = read_toml(path, error, f"config file {str(path)!r} does not exist (an example ships as config/k2edge.toml)")
    return _resolve(data, path.resolve().parent)


def load_config(path: str | os.PathLike | None = None) -> DaemonConfig:
    """Read and validate the daemon config.

    Raises:
        ConfigError: missing file, TOML syntax error (with line), or invalid keys (with field paths).
    """
    p = Path(path) if path else DEFAULT_PATH
    data = read_config(p)
    try:
        cfg = DaemonConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{p}: {describe_validation_error(exc, model_keys(DaemonConfig), toml=True)}") from None
    cfg._source = p
    return cfg


def check_profiles(cfg: DaemonConfig) -> None:
    """Every profile a model names is found and valid, and every data set it names exists (the daemon asks before it
    starts anything; commands that read the config for other keys do not need them on this machine); the error
    names the key.

    Raises:
        ConfigError: ``models.N.profile`` or ``models.N.escalation.warm_profile`` names no valid profile,
            ``models.N.calib`` / ``models.N.check`` no file or folder, or ``models.N.onnx`` no file.
    """
    from ..errors import ProfileError
    from ..profile import load_profile

    path = cfg.where
    for i, m in enumerate(cfg.models):
        for key in ("calib", "check"):
            given = getattr(m, key)
            if given is not None and not given.exists():
                raise ConfigError(f"{path}: models.{i}.{key}: {str(given)!r} does not exist")
        named = (("profile", m.profile if m.onnx is not None or m.profile_set else None),  # a bundle brings its own
                 ("escalation.warm_profile", m.escalation.warm_profile))
        for key, profile in named:
            if profile:
                try:
                    load_profile(profile)
                except ProfileError as exc:
                    raise ConfigError(f"{path}: models.{i}.{key}: {exc}") from None
        if m.onnx is not None and not m.onnx.is_file():  # before any model is built: a build can take minutes
            raise ConfigError(f"{path}: models.{i}.onnx: {str(m.onnx)!r} " +
                              ("is a directory, not an .onnx file" if m.onnx.is_dir() else "does not exist"))


def state_dir(cfg: DaemonConfig) -> Path:
    """Where the outbox and other state live: the config's, else systemd's $STATE_DIRECTORY, else ~/.local/state."""
    if cfg.service.state_dir:
        return Path(cfg.service.state_dir)
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(os.pathsep)[0])
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "k2edge"


def read_secret(path: Path | None = None, credential: str | None = None, what: str = "secret") -> str | None:
    """A secret from a file or a systemd credential; stripped of the trailing newline.

    Raises:
        ConfigError: the file or credential is missing or empty (an empty token would let an empty one in: the
            message names where, never the value).
    """
    if credential:
        directory = os.environ.get("CREDENTIALS_DIRECTORY")
        if not directory:
            raise ConfigError(f"{what}: credential {credential!r} requested but $CREDENTIALS_DIRECTORY is not set "
                              f"(add LoadCredential={credential}:/path to the unit)")
        path = Path(directory) / credential
    if path is None:
        return None
    try:
        secret = read_small(path, MAX_SECRET_BYTES).decode("utf-8").rstrip("\r\n")
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {str(path)!r} ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what}: {str(path)!r} is not UTF-8 text (byte {exc.start})") from None
    if not secret.strip():
        raise ConfigError(f"{what}: {str(path)!r} is empty; put the secret in it")
    return secret
