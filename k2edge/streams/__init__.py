"""Video streams: sources, newest-frame readers, tracking, zones and lines.

A stream is a video source bound to a served detection model. One reader per stream decodes
continuously and keeps only the newest frame (an older one never processed is counted as dropped);
a tracker per stream gives detections track ids, and zones and lines turn tracks into events.
Sources never block the daemon: every wait is bounded, and a failure is a state with a reason.
"""
