"""The daemon (:mod:`~k2edge.service.daemon`, built in one place): per model a batcher
(:mod:`~k2edge.service.batcher`) over its two clients, MQTT requests (:mod:`~k2edge.service.request_path`)
and stream frames (:mod:`~k2edge.service.stream_path`); replies and the answer book; cloud escalation and
its local fallbacks; deploys; the MQTT 5 transport, health and sd_notify.

Pure pieces (topics, request parsing, answer bodies, statistics) live apart from the network client.
"""
