"""Video streams: sources, newest-frame readers, tracking, zones and lines (see design.md, "Streams")."""
