"""The daemon: MQTT 5 transport, request schema, scheduler/batcher, health and sd_notify.

Pure pieces (topics, request parsing, responses, statistics) live apart from the network client.
"""
