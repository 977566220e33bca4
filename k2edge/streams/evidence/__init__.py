"""Evidence for stream events: a snapshot of the frame an event was raised on (drawn and encoded
off the model's thread), and the media store that keeps it beside the event store."""

from .media import MediaStore
from .snapshot import Snapshot, render_snapshot
from .worker import EvidenceWorker

__all__ = ["EvidenceWorker", "MediaStore", "Snapshot", "render_snapshot"]
