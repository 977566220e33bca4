"""The daemon: the request path (one module), the answer book, the MQTT 5 transport, cloud
escalation, health and sd_notify.

Pure pieces (topics, request parsing, answer bodies, statistics) live apart from the network client.
"""
