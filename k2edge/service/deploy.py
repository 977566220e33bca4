"""The fleet model lifecycle in the daemon: verified loading, over-the-air deploys, hot swap, rollback, audit.

**At start** (:meth:`ModelLifecycle.initial`), each ``[[models]]`` entry runs, in this order of
precedence: the version current in the state directory (re-verified against today's trusted keys:
a removed key revokes what it signed), else the config's ``bundle`` (installed as the first
version, made current once its engines are built), else the config's bare ``onnx`` (refused when
``[trust]`` is set without ``allow_unsigned``). A refusal stops the start with one line, which
names the way out (a stopped daemon takes no deploy), and its audit record goes to the broker on a
connection of its own before the daemon exits (:meth:`AuditTrail.leave`).

**Over the air**, deploy and rollback messages arrive on a connection of their own (the *control
connection*, client id ``{client_id}-control``): MQTT acknowledges QoS 1 messages in arrival order
on a connection, so a deploy that waits minutes for its engines would otherwise hold back the
acknowledgement of every request behind it, and the broker would stop delivering requests. One
worker thread takes them in order, never the network thread nor a model's batcher:

    parse -> fetch (a URL, over HTTPS) -> ModelStore.install (verify + unpack) -> build the engines
    through the engine cache (progress in status) -> swap between two batches -> ModelStore.activate
    -> answer, and acknowledge the message once the broker has the answer.

A failure at any step keeps the running version (a failed pointer write swaps the old engines
back). Every store result (install, activate, load, rollback; loaded or refused) is one line in
``STATE/audit.log`` and the same JSON on ``{prefix}/audit``.

**Exactly once.** A message is acknowledged only after its answer is delivered, so a crash
leaves it with the broker, which redelivers it; carrying it out again changes nothing: a deploy is
idempotent by its manifest's sha256 and version (the same bundle already current is answered
``deployed`` without a rebuild), and a rollback writes its message digest into the model's pointer
in the same atomic replace as the change, so a redelivered rollback is recognised as done.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from .. import tracing
from ..bundle import AuditLog, BundleResult, DamagedState, Limits, ModelStore, audit_record, load_trust
from ..bundle.audit import AUDIT_NAME
from ..config.card import ModelCard, find_card
from ..config.schema import ConfigError, DaemonConfig, ModelConfig
from ..errors import Int8CheckRefused, K2EdgeError, first_line
from . import topics
from .deploy_protocol import (DEPLOYED, FAILED, REFUSED, ROLLED_BACK, ControlError, answer_body, message_digest,
                              parse_deploy, parse_rollback)

log = logging.getLogger(__name__)

MAX_WAITING = 4  # deploys held in memory (each up to max_bundle_bytes); beyond, the broker keeps them
LEAVE_WAIT_S = 5.0  # a daemon that does not start waits this long for the broker to take its audit records
SWAP_TIMEOUT_S = 60.0  # a batcher whose batches do not finish within this is wedged: the deploy fails


@dataclass(frozen=True)
class Plan:
    """What to build for a model: the config of one version, and what to record once it runs."""

    config: ModelConfig
    version: str | None
    source: str
    activate: bool = False  # a first version from the config's bundle: make it current once built


class DeployHost(Protocol):
    """What the lifecycle asks of the daemon (a Protocol: the daemon imports this module)."""

    def build_runtime(self, config: ModelConfig, version: str | None):
        """An activated ModelRuntime of one model version (raises on failure)."""

    def deployed(self, name: str) -> None:
        """A swap was committed: policy, metrics, status."""

    def publish_status(self) -> None:
        """The worker's state changed: republish the retained status."""


@dataclass(frozen=True)
class _Job:
    kind: str
    topic: str
    payload: bytes
    content_type: str | None
    user: dict
    response_topic: str | None
    correlation: bytes | None
    token: object
    log: dict = field(default_factory=dict)  # what the log line says of a deploy: source, key id

    @property
    def digest(self) -> str:
        return message_digest(self.kind, self.payload, self.response_topic, self.correlation)


def version_config(m: ModelConfig, paths: dict) -> ModelConfig:
    """``m`` pointed at an installed version's files; the config's ``profile`` and card table win.

    Raises:
        ConfigError: the config has a card table to layer, but the bundle's card does not lie beside
            its model (where the engine finds the card under the table).
    """
    update = {"onnx": paths["model"], "labels": paths["labels"], "calib": paths["calib"]}
    if not m.profile_set and paths["profiles"]:
        update["profile"] = str(paths["profiles"][0])
    if isinstance(m.card, ModelCard):
        if paths["card"] is not None and find_card(paths["model"]) != paths["card"]:
            raise ConfigError(f"model {m.name}: the bundle's card {paths['card'].name} does not lie beside its model, "
                              "so the config's card table cannot be layered over it")
    else:
        update["card"] = paths["card"]
    return m.model_copy(update=update)


class _Stopping(Exception):
    """The daemon drains: a deploy not committed yet is dropped unanswered (the broker redelivers it)."""


def control_subscriptions(cfg: DaemonConfig) -> list[str]:
    """The control connection's topic filters: this device's and its fleet group's."""
    p, group = cfg.prefix, cfg.fleet.group
    subs = [topics.deploy_topic(p), topics.rollback_topic(p)]
    if group:
        subs += [topics.group_deploy_topic(group), topics.group_rollback_topic(group)]
    return subs


class AuditTrail:
    """Every store result, as one line in ``STATE/audit.log`` and the same JSON on ``{prefix}/audit``
    (kept until the control connection is up).

    Args:
        cfg: the daemon config.
        state: the state directory.
        control: the control connection (``publish``, ``connected``).
    """

    def __init__(self, cfg: DaemonConfig, state: Path, control) -> None:
        self.cfg, self.device, self.control = cfg, cfg.device_id, control
        self.audit_log = AuditLog(Path(state) / AUDIT_NAME)
        self._lock = threading.Lock()
        self._unpublished: list[dict] = []

    def audit(self, result: BundleResult, action: str, source: str, **extra) -> dict:
        """Write one result to ``audit.log`` and publish it on ``{prefix}/audit``."""
        try:
            record = self.audit_log.write(result, action, source, device=self.device, **extra)
        except OSError as exc:
            log.error("audit log %s not writable (%s); the record goes to MQTT only", self.audit_log.path, exc.strerror)
            record = audit_record(result, action, source, device=self.device, **extra)
        (log.info if result.ok else log.warning)("audit: %s %s: %s", action, source, result.line)
        self._publish(record)
        return record

    def flush(self) -> None:
        """The control connection is up: publish the records made while it was not."""
        with self._lock:
            pending, self._unpublished = self._unpublished, []
        for record in pending:
            self._publish(record)

    def _publish(self, record: dict) -> None:
        with self._lock:
            if not self.control.connected.is_set():
                self._unpublished.append(record)
                return
        self.control.publish(topics.audit_topic(self.cfg.prefix), json.dumps(record, default=str).encode(), qos=1)

    def leave(self, timeout_s: float = LEAVE_WAIT_S) -> int:
        """The daemon stops before its connections ever started (a refusal at start): publish the records still
        kept on a connection of their own, which subscribes to nothing (the control connection's would take
        deploys it could not carry out), waiting at most ``timeout_s`` for the broker; returns how many it has.
        Each stays in ``audit.log`` either way."""
        with self._lock:
            pending, self._unpublished = self._unpublished, []
        if not pending:
            return 0
        from .transport import MqttTransport

        cfg = self.cfg
        mqtt_cfg = cfg.mqtt.model_copy(update={"client_id": f"{cfg.client_id}-audit", "session_expiry_s": 1})
        conn = MqttTransport(cfg.model_copy(update={"mqtt": mqtt_cfg}), "audit", [])
        delivered = threading.Semaphore(0)
        end = time.monotonic() + timeout_s
        conn.start(_Publisher())
        try:
            for record in pending:
                conn.publish(topics.audit_topic(cfg.prefix), json.dumps(record, default=str).encode(), qos=1,
                             on_delivered=delivered.release)
            got = sum(delivered.acquire(timeout=max(0.0, end - time.monotonic())) for _ in pending)
        finally:
            conn.stop()
        if got < len(pending):
            log.warning("%d audit record(s) did not reach the broker within %.0f s; they are in %s", len(pending) - got,
                        timeout_s, self.audit_log.path)
        return got


class _Publisher:
    """The handler of a connection that only publishes."""

    def on_message(self, msg, token) -> None:  # never called: nothing is subscribed
        pass

    def on_connected(self) -> None:
        pass

    def saturated(self) -> bool:
        return False


class Versions:
    """Which version of each model runs at start, from the trusted store (see the module docstring).

    Args:
        cfg: the daemon config.
        state: the state directory (``models/``).
        trail: the audit trail.

    Raises:
        BundleError: a ``[trust]`` key file is not a public key.
    """

    def __init__(self, cfg: DaemonConfig, state: Path, trail: AuditTrail) -> None:
        self.cfg, self.trail = cfg, trail
        trust = cfg.trust
        self.store = ModelStore(state, load_trust(trust.keys), Limits.from_settings(cfg.deploy), trust.allow_unsigned) \
            if trust is not None else None

    def initial(self, m: ModelConfig) -> Plan:
        """Where ``m`` comes from at start (see the module docstring).

        Raises:
            ConfigError: the version to run is refused (audited), or a bare onnx is not allowed.
        """
        store, audit = self.store, self.trail.audit
        try:
            current = store.current(m.name) if store is not None else None
        except DamagedState as exc:  # anti-rollback cannot be judged: a person decides which version runs
            audit(BundleResult(FAILED, str(exc), m.name), "load", f"state:{store.root / m.name}")
            raise ConfigError(f"model {m.name}: {exc}") from None
        if current is not None:
            result = store.load(m.name)
            audit(result, "load", f"state:{store.root / m.name / current}")
            if not result.ok:
                # A daemon that does not start takes no deploy: the way out is on this device.
                start_from = "bundle" if m.bundle is not None else "onnx" if self.cfg.trust.allow_unsigned else \
                    "onnx (a bare onnx needs [trust] allow_unsigned = true)"
                raise ConfigError(f"model {m.name}: the installed version {current} is refused: {result.line} (trust its "
                                  f"key again, or move {store.root / m.name} aside to start from the config's {start_from})")
            return Plan(version_config(m, result.paths), result.version, "state")
        if m.bundle is not None:
            result = store.install(m.bundle, expected_name=m.name)
            audit(result, "install", f"config:{m.bundle}")
            if not result.ok:
                raise ConfigError(f"model {m.name}: bundle {m.bundle}: {result.line}")
            return Plan(version_config(m, result.paths), result.version, f"config:{m.bundle}", activate=True)
        if self.cfg.trust is not None and not self.cfg.trust.allow_unsigned:
            audit(BundleResult("unsigned", f"{m.onnx} is a bare ONNX file and [trust] allow_unsigned is off", m.name),
                  "load", f"config:{m.onnx}")
            raise ConfigError(f"model {m.name}: a bare onnx path is refused when [trust] keys are set; give "
                              'bundle = "FILE.k2b" signed by a trusted key, or set [trust] allow_unsigned = true')
        return Plan(m, None, f"config:{m.onnx}")

    def started(self, plan: Plan) -> None:
        """The plan's engines run: make a first version from the config's bundle current.

        Raises:
            ConfigError: the pointer cannot be written.
        """
        if plan.activate:
            result = self.store.activate(plan.config.name, plan.version)
            self.trail.audit(result, "activate", plan.source)
            if not result.ok:
                raise ConfigError(f"model {plan.config.name}: {result.line}")


class ModelLifecycle:
    """Deploys and rollbacks: the control connection's handler and its worker thread.

    Args:
        cfg: the daemon config.
        versions: the trusted store (None without ``[trust]``: deploys are refused).
        control: the control connection (answers, acknowledgements).
        batchers: each served model's batcher (a deploy swaps its engines).
        host: builds runtimes and announces deploys (the daemon).
    """

    def __init__(self, cfg: DaemonConfig, versions: Versions, control, batchers: dict, host: DeployHost) -> None:
        self.cfg = cfg
        self.device = cfg.device_id
        self.store = versions.store
        self.trail = versions.trail
        self.control, self.batchers, self.host = control, batchers, host
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="k2edge-deploy", daemon=True)
        self._progress: dict = {"state": "idle"}
        self._trace = None  # the running job's spans (tracing on): its progress states are its phases
        self._stopping = threading.Event()
        self.last: dict | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop taking jobs; a deploy still building is dropped before its swap (waiting at most
        ``timeout`` for the worker). Messages not answered stay with the broker for the next start."""
        self._stopping.set()
        if self._thread.is_alive():
            while True:  # jobs not started are dropped: unacknowledged, the broker redelivers them
                try:
                    self._jobs.get_nowait()
                except queue.Empty:
                    break
            self._jobs.put(None)
            self._thread.join(timeout)

    def saturated(self) -> bool:
        return self._jobs.qsize() >= MAX_WAITING

    def on_connected(self) -> None:
        """The control connection is up: publish audit records made while it was not."""
        self.trail.flush()

    def on_message(self, msg, token) -> None:
        """A deploy or rollback message (network thread: queue it, nothing more)."""
        props = getattr(msg, "properties", None)
        kind = topics.control_kind(msg.topic)
        if kind is None:
            self.control.done(token)
            return
        user = {str(k): str(v) for k, v in (getattr(props, "UserProperty", None) or [])}
        self._jobs.put(_Job(kind, msg.topic, bytes(msg.payload), getattr(props, "ContentType", None), user,
                            getattr(props, "ResponseTopic", None) or None, getattr(props, "CorrelationData", None), token))

    def status(self) -> dict:
        """For the retained status: what the worker does now, and the last answer."""
        return {**self._progress, "last": self.last}

    def audit(self, result: BundleResult, action: str, source: str, **extra) -> dict:
        return self.trail.audit(result, action, source, **extra)

    # -- the worker ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._trace = tracing.tracer().operation(job.kind, "receiving", {"k2edge.deploy.topic": job.topic})
            try:
                body = self._deploy(job) if job.kind == "deploy" else self._rollback(job)
            except _Stopping:
                log.warning("%s on %s left unanswered: the daemon is stopping (the broker redelivers it)", job.kind, job.topic)
                self._progress = {"state": "idle"}
                return
            except Exception as exc:  # a bug must not end the worker; the running version stays
                log.exception("%s on %s failed", job.kind, job.topic)
                body = self._answer_body(FAILED, reason=f"internal error: {type(exc).__name__}: {first_line(exc)}")
            finally:
                self._progress = {"state": "idle"}
            self._answer(job, body)
            if self._trace is not None:  # verify -> build (and its INT8 check) -> swap, with the outcome
                self._trace.end(body["status"], **{"k2edge.model": body["model"], "k2edge.version": body["version"],
                                                   "k2edge.deploy.check": body["check"]})
            self.host.publish_status()

    def _set_progress(self, state: str, **what) -> None:
        self._progress = {"state": state, **what, "since": time.time()}
        if self._trace is not None:
            self._trace.mark(state, **{f"k2edge.{k}": v for k, v in what.items() if v is not None})
        self.host.publish_status()

    def _running_version(self, name: str | None) -> str | None:
        rt = self.batchers[name].next_runtime() if name in self.batchers else None
        return rt.version if rt is not None else None

    def _names(self) -> set[str]:
        return {m.name for m in self.cfg.models}

    def _answer_body(self, status: str, model: str | None = None, version: str | None = None, reason: str = "",
                     check: str | None = None, previous: str | None = None) -> dict:
        running = {name: self._running_version(name) for name in sorted(self._names())}
        return answer_body(status, self.device, model, version, reason, check, self._running_version(model), previous, running)

    def _answer(self, job: _Job, body: dict) -> None:
        self.last = {**body, "kind": job.kind, "time": time.time()}
        topic = job.response_topic if job.response_topic and topics.publishable(job.response_topic) \
            else topics.control_result_topic(self.cfg.prefix)
        # acknowledged once the broker has the answer: a crash before leaves the message with the broker
        self.control.publish(topic, json.dumps(body).encode(), qos=1, correlation=job.correlation,
                             on_delivered=lambda: self.control.done(job.token))
        if body["model"] is not None:  # a change made is news; one refused or failed is a warning
            log.log(logging.INFO if body["status"] in (DEPLOYED, ROLLED_BACK) else logging.WARNING, "%s: %s %s %s: %s",
                    job.kind, body["status"], body["model"], body["version"], body["reason"])
        else:  # refused before a manifest could be trusted: name what was sent and who signed it
            key = job.log.get("key_id")
            log.warning("%s: %s %s: %s: %s%s", job.kind, body["status"], job.log.get("source", job.topic),
                        body["check"] or "refused", body["reason"], f" (key id {key[:16]}…)" if key else "")

    def _deploy(self, job: _Job) -> dict:
        self._set_progress("receiving", kind="deploy")
        try:
            req = parse_deploy(job.payload, job.content_type, job.user)
        except ControlError as exc:
            return self._answer_body(REFUSED, reason=str(exc), check="bad_request")
        if self.store is None:
            return self._answer_body(REFUSED, reason="this device has no [trust] table: it takes no deployments",
                                     check="no_trust")
        source, data = f"mqtt:{job.topic}", req.bundle
        job.log["source"] = req.source
        if req.url is not None:
            from ..bundle.fetch import FetchError, fetch_bundle

            self._set_progress("fetching", kind="deploy", url=req.url)
            try:
                data = fetch_bundle(req.url, req.sha256, self.store.limits.max_bundle_bytes, self.cfg.deploy.ca_file)
            except FetchError as exc:
                self.audit(BundleResult(exc.status, exc.detail), "fetch", req.url, request=job.digest)
                failed = exc.status == FAILED  # the fetch itself (unreachable, 404, TLS): check says so, not "failed"
                return self._answer_body(FAILED if failed else REFUSED, reason=exc.detail,
                                         check="fetch_failed" if failed else exc.status)
            source = req.url
        self._set_progress("verifying", kind="deploy")
        result = self.store.install(data, allow_downgrade=req.allow_downgrade, expected_name=self._names())
        self.audit(result, "install", source, request=job.digest)
        job.log["key_id"] = result.key_id
        if result.status == "current":  # this very version runs: its files checked, its signature the bundle's
            return self._answer_body(DEPLOYED, result.name, result.version, check="already_current", reason=result.detail)
        if not result.ok:
            return self._answer_body(FAILED if result.status == FAILED else REFUSED, result.name, result.version,
                                     result.detail, result.status)
        name, version = result.name, result.version
        return self._switch(name, version, result.paths, source, "activate", DEPLOYED,
                            lambda: self.store.activate(name, version))

    def _rollback(self, job: _Job) -> dict:
        self._set_progress("receiving", kind="rollback")
        try:
            req = parse_rollback(job.payload)
        except ControlError as exc:
            return self._answer_body(REFUSED, reason=str(exc), check="bad_request")
        if self.store is None:
            return self._answer_body(REFUSED, req.model, reason="this device has no [trust] table: it keeps no versions",
                                     check="no_trust")
        if req.model not in self._names():
            return self._answer_body(REFUSED, req.model, reason=f"no model {req.model!r} here; served: {sorted(self._names())}",
                                     check="unknown_model")
        source, name = f"mqtt:{job.topic}", req.model
        try:
            ptr = self.store.pointer(name)
        except DamagedState as exc:
            result = BundleResult(FAILED, str(exc), name)
            self.audit(result, "rollback", source, request=job.digest)
            return self._answer_body(FAILED, name, self._running_version(name), result.detail, "failed")
        if ptr["rollback"] == job.digest and ptr["current"] == self._running_version(name):
            return self._answer_body(ROLLED_BACK, name, ptr["current"], check="rolled_back", previous=ptr["previous"],
                                     reason=f"{name} was rolled back to {ptr['current']} by this request already")
        if ptr["previous"] is None:
            result = BundleResult("no_previous", f"{name} has no previous version to roll back to", name, ptr["current"])
            self.audit(result, "rollback", source, request=job.digest)
            return self._answer_body(REFUSED, name, ptr["current"], result.detail, result.status)
        target = ptr["previous"]
        self._set_progress("verifying", kind="rollback", model=name, version=target)
        result = self.store.load(name, target)
        if not result.ok:
            self.audit(result, "rollback", source, request=job.digest)
            return self._answer_body(REFUSED, name, target, result.detail, result.status)
        return self._switch(name, target, result.paths, source, "rollback", ROLLED_BACK,
                            lambda: self.store.rollback(name, request=job.digest))

    def _switch(self, name: str, version: str, paths: dict, source: str, action: str, status: str,
                commit: Callable[[], BundleResult]) -> dict:
        """Build ``version``'s engines, swap them in between batches (once), then commit the pointer."""
        batcher = self.batchers[name]
        running = batcher.next_runtime()
        kind = "rollback" if action == "rollback" else "deploy"  # what the status says is going on
        self._set_progress("building", kind=kind, model=name, version=version)
        try:
            rt = self.host.build_runtime(version_config(self.cfg.model(name), paths), version)
        except Int8CheckRefused as exc:  # built, and refused by [trust] require_int8_check: answered as a failed check
            result = BundleResult(FAILED, f"{first_line(exc)}; {running.version or 'the running model'} keeps running",
                                  name, version)
            self.audit(result, "build", source)
            return {**self._answer_body(FAILED, name, version, result.detail, "int8_check"), "int8_check": exc.check.to_dict()}
        except Exception as exc:  # K2EdgeError from the engine, or anything a backend raises
            if not isinstance(exc, K2EdgeError):
                log.exception("model %s %s: building the engines failed", name, version)
            result = BundleResult(FAILED, f"building the engines of {name} {version} failed: {first_line(exc)}", name, version)
            self.audit(result, "build", source)
            return self._answer_body(FAILED, name, version, result.detail, "build_failed")
        if self._stopping.is_set():  # nothing committed yet: the next start carries the redelivered message out
            rt.deactivate()
            raise _Stopping
        check = rt.int8_check
        if action != "rollback" and check is not None and check.status == "failed":
            # the build kept the best it found, but a new version must not serve worse answers than the one running
            rt.deactivate()
            result = BundleResult(FAILED, f"{name} {version}: {check.line()}; "
                                          f"{running.version or 'the running model'} keeps running", name, version)
            self.audit(result, "build", source)
            return {**self._answer_body(FAILED, name, version, result.detail, "int8_check"), "int8_check": check.to_dict()}
        self._set_progress("swapping", kind=kind, model=name, version=version)
        old = batcher.swap(rt, SWAP_TIMEOUT_S)
        if old is None:
            rt.deactivate()
            result = BundleResult(FAILED, f"model {name}'s batches did not finish within {SWAP_TIMEOUT_S:g} s; "
                                          f"{running.version or 'the running model'} keeps running", name, version)
            self.audit(result, "swap", source)
            return self._answer_body(FAILED, name, version, result.detail, "swap_timeout")
        result = commit()
        self.audit(result, action, source)
        if not result.ok:  # the pointer still names the old version: run it again
            if batcher.swap(old, SWAP_TIMEOUT_S) is not None:
                rt.deactivate()
            return self._answer_body(FAILED, name, version, result.detail, result.status)
        old.deactivate()
        self.host.deployed(name)
        return {**self._answer_body(status, name, version, result.detail, result.status, previous=old.version),
                "int8_check": check.to_dict() if check is not None else None}
