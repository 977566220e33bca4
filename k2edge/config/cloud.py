"""Schema of the daemon config's ``[cloud]`` table and each model's ``escalation`` table.

The API key is never a setting: the settings name where it lives (a file, a systemd credential,
an environment variable); :func:`k2edge.cloud_bridge.resolve_api_key` reads it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import ConfigDict, Field, field_validator, model_validator

from .tables import Strict, bound

__all__ = ["CloudSettings", "EscalationSettings", "MOONSHOT_BASE_URL", "K2_TEMPERATURE", "shown_key_path"]

MOONSHOT_BASE_URL = "https://api.moonshot.ai/v1"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
K2_TEMPERATURE = 0.6  # Moonshot's recommendation for Kimi K2 Instruct


class CloudSettings(Strict):
    """One K2 endpoint and how the bridge talks to it.

    Attributes:
        base_url: the OpenAI-compatible base (``https://api.moonshot.ai/v1``, a vLLM/SGLang
            ``http://host:8000/v1``), or the Anthropic-compatible one in ``mode = "anthropic"``
            (``https://api.moonshot.ai/anthropic``).
        model: the model id (read ``k2edge cloud check`` for what the server lists).
        mode: ``openai`` (chat completions through the official SDK) or ``anthropic`` (messages API).
        api_key_file / api_key_env / api_key_credential: where the key is (at most one; none
            for a self-hosted server without auth). The credential is systemd's
            ``$CREDENTIALS_DIRECTORY/<name>`` (``LoadCredential=`` in the unit).
        timeout_s: per HTTP attempt (the request's deadline cuts it shorter).
        max_retries: extra attempts on 429/5xx/connection errors, within the deadline.
        concurrency: cloud calls in flight at once; more wait (within their deadline), then answer locally.
        temperature: effective sampling temperature (0.6, K2's recommendation). In anthropic
            mode the bridge sends ``temperature / 0.6`` because that endpoint multiplies by 0.6.
        max_tokens: cap on the answer's length.
        requests_per_minute: cloud request budget (sliding 60 s window); None = unlimited.
        breaker_failures: consecutive failed calls that open the circuit breaker.
        breaker_cooldown_s: how long it stays open before one probe is let through.
        image_max_side: images are downscaled so their longer side is at most this (pixels cost tokens).
        vision: ``on`` sends images; ``off`` sends the edge's findings as text instead; ``auto``
            (default) sends images until the server refuses image content (a self-hosted text-only
            K2 refuses ``image_url`` parts), then text. A refusal is not an outage: it never counts
            against the circuit breaker.
        system_prompt: the system message sent with every request.
        deadline_reserve_ms: time kept back from a request's deadline for the local fallback and the publish
            (at least this, and at least a tenth of the time left when the cloud is asked).
        outbox_ttl_s: a deferred request older than this is delivered as an error instead.
        outbox_path: the outbox database (default: ``outbox.sqlite3`` in the daemon's state directory).
        stream_share: streams' escalations may use at most this share of ``requests_per_minute`` (default 0.5),
            so cameras never starve MQTT requests; requests may use the whole budget.
    """

    model_config = ConfigDict(frozen=False)  # Strict's rules, not frozen

    base_url: str = MOONSHOT_BASE_URL
    model: str | None = None
    mode: Literal["openai", "anthropic"] = "openai"
    api_key_file: Path | None = None
    api_key_env: str | None = None
    api_key_credential: str | None = Field(None, validate_default=True)
    timeout_s: float = Field(10.0, gt=0, le=600)
    max_retries: int = Field(2, ge=0, le=10)
    concurrency: int = Field(4, ge=1, le=256)
    temperature: float = Field(K2_TEMPERATURE, ge=0, le=2)
    max_tokens: int = Field(512, ge=1, le=65536)
    requests_per_minute: int | None = Field(60, ge=1)
    breaker_failures: int = Field(5, ge=1, le=1000)
    breaker_cooldown_s: float = Field(30.0, gt=0, le=86400)
    vision: Literal["auto", "on", "off"] = Field(
        "auto", description="send images to K2: on; off: the edge's findings as text; auto: images until the server "
                            "refuses image content (a text-only deployment), then text")
    image_max_side: int = Field(768, ge=32, le=8192)
    system_prompt: str = ("You are the cloud expert behind an on-device image classifier. Answer the user's question "
                          "about the image briefly; the classifier's top guesses are context, not ground truth.")
    deadline_reserve_ms: int = Field(50, ge=0, le=10_000)
    outbox_ttl_s: float = Field(86400.0, gt=0)
    outbox_path: Path | None = None
    stream_share: float = Field(0.5, ge=0, le=1, description="the share of requests_per_minute stream escalations may "
                                "use; MQTT requests keep the rest")

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        # the URL is shown in the status, in traces and by `cloud check`: a password or a key in it would go with it
        shown = "(not repeated: it may hold a secret)" if "@" in v or "?" in v else repr(v[:120])
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {shown}")
        try:
            parts = urlsplit(v)
            parts.port  # noqa: B018 (parsing the port raises on a bad one)
        except ValueError as exc:
            raise ValueError(f"not a URL ({exc}): {shown}") from None
        if "@" in parts.netloc:
            raise ValueError(f"must not hold user:password@ (the key goes in api_key_file, api_key_env or "
                             f"api_key_credential): {shown}")
        if parts.query or parts.fragment or v.endswith(("?", "#")):
            raise ValueError(f"must not hold a query or fragment (an OpenAI-compatible base URL is scheme, host and "
                             f"path; a key goes in api_key_file, api_key_env or api_key_credential): {shown}")
        if not parts.hostname:
            raise ValueError(f"names no host: {shown}")
        return v.rstrip("/")

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not _ENV_NAME.match(v):  # not repeated: a key pasted here by mistake must not be shown
            raise ValueError("must name an environment variable (letters, digits and '_', not starting with a digit), "
                             "not hold the key itself")
        return v

    @field_validator("api_key_credential")
    @classmethod
    def _credential_name(cls, v):
        if v is not None and ("/" in v or not v):
            raise ValueError(f"a credential name, not a path, got {v!r}")
        return v

    @model_validator(mode="after")
    def _one_key_source(self):
        given = [n for n in ("api_key_file", "api_key_env", "api_key_credential") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of api_key_file, api_key_env, api_key_credential; got {', '.join(given)}")
        return self

    def key_source(self) -> str:
        """Where the key comes from, in words (never the key)."""
        if self.api_key_file:
            return f"file {shown_key_path(self.api_key_file)}"
        if self.api_key_env:
            return f"environment variable {shown_env_name(self.api_key_env)}"
        if self.api_key_credential:
            return f"systemd credential {self.api_key_credential}"
        return "none (no API key configured)"


def _may_be_a_key(name: str) -> bool:
    """A name of 20 characters or more, without a dot, mixing letters and digits may be a key pasted in its place."""
    return len(name) >= 20 and "." not in name and any(c.isdigit() for c in name) and any(c.isalpha() for c in name)


def shown_env_name(name: str) -> str:
    """``api_key_env`` as a message may show it: a name that may be the key itself (:func:`_may_be_a_key`, with lower
    case in it, as an environment variable's name rarely has) is replaced by its length."""
    if _may_be_a_key(name) and any(c.islower() for c in name):
        return f"<a name of {len(name)} characters, not shown: it may be a key>"
    return name


def shown_key_path(path: str | os.PathLike) -> str:
    """``api_key_file`` as a message may show it: a file name of 20 characters or more, without a dot, mixing letters
    and digits may be the key itself, pasted in place of its path, and is replaced by its length."""
    p = Path(path)
    name = p.name
    if _may_be_a_key(name):
        hidden = f"<a name of {len(name)} characters, not shown: it may be a key>"
        return hidden if p.parent == Path(".") else str(p.parent / hidden)
    return str(p)


class EscalationSettings(Strict):
    """When one model's requests go to the cloud.

    Confidence is in [0, 1], higher is surer, by ``measure``:
    ``max_softmax`` = top-1 probability; ``margin`` = top-1 minus top-2 probability;
    ``entropy`` = 1 - H(p) / ln(classes) (1: all mass on one class, 0: uniform).
    A request escalates when its confidence is below ``threshold``; in the ``warm`` state below
    ``warm_threshold`` (default: halfway from ``threshold`` to 1, so low confidence escalates sooner).

    Detectors (card ``task = "detection"``) take a detection measure instead:
    ``max_box_score`` = the best box's score (0 when nothing is found): escalate when below
    ``threshold`` (nothing found confidently); ``uncertain_boxes``: escalate when any box scores
    within [``low``, ``high``). In ``warm`` the band widens as the classifier threshold does:
    ``low`` halfway to 0, ``high`` halfway to 1 (``warm_low`` / ``warm_high`` set them). Boxes the
    card's ``score_threshold`` drops are never seen: keep it at or below ``low``.

    Attributes:
        allow_cloud: the default for requests that do not say.
        prompts: a request carrying a text prompt needs language understanding the edge has no
            model for: ``cloud`` (default) sends it to K2 with the edge's top-k; ``local`` ignores
            the prompt and answers with the classifier.
        warm_profile: the model's DLA-heavier profile, used in the warm and hot states.
    """

    model_config = ConfigDict(frozen=False)  # Strict's rules, not frozen

    measure: Literal["max_softmax", "margin", "entropy", "max_box_score", "uncertain_boxes"] = "max_softmax"
    threshold: float = Field(0.5, ge=0, le=1)
    warm_threshold: float | None = Field(None, ge=0, le=1)
    low: float = Field(0.25, ge=0, le=1, description="uncertain_boxes: the band's lower end")
    high: float = Field(0.6, ge=0, le=1, description="uncertain_boxes: the band's upper end (excluded)")
    warm_low: float | None = Field(None, ge=0, le=1)
    warm_high: float | None = Field(None, ge=0, le=1)
    allow_cloud: bool = True
    prompts: Literal["cloud", "local"] = "cloud"
    warm_profile: str | None = None

    _warm_not_lower = bound("warm_threshold", ">=", "threshold", "warm escalates sooner, not later")
    _band = bound("high", ">", "low")
    _warm_low_wider = bound("warm_low", "<=", "low", "warm widens the band")
    _warm_high_wider = bound("warm_high", ">=", "high", "warm widens the band")

    def band(self, warm: bool = False) -> tuple[float, float]:
        """The ``uncertain_boxes`` band [low, high), widened in the warm state."""
        if not warm:
            return self.low, self.high
        low = self.warm_low if self.warm_low is not None else self.low / 2
        high = self.warm_high if self.warm_high is not None else self.high + (1.0 - self.high) / 2
        return low, high

    def for_task(self, task: str, where: str = "escalation") -> "EscalationSettings":
        """These settings for a model of ``task``: a detector left on the default measure judges
        ``max_box_score``; a measure that does not fit the task is refused (naming ``where``).

        Raises:
            ValueError: a classifier measure for a detector, or a detection measure for a classifier.
        """
        detection_measure = self.measure in ("max_box_score", "uncertain_boxes")
        if task in ("detection", "segmentation", "pose", "obb") and not detection_measure:  # judged by their boxes
            if "measure" not in self.model_fields_set:
                return self.model_copy(update={"measure": "max_box_score"})
            raise ValueError(f"{where}.measure: {self.measure} judges a classifier; a detection model takes max_box_score "
                             "or uncertain_boxes")
        if task == "classification" and detection_measure:
            raise ValueError(f"{where}.measure: {self.measure} judges boxes; a classification model takes max_softmax, "
                             "margin or entropy")
        return self

    @property
    def effective_warm_threshold(self) -> float:
        return self.warm_threshold if self.warm_threshold is not None else self.threshold + (1.0 - self.threshold) / 2
