"""Engines: backends that apply a PartitionPlan, the lane pipeline, the prefetch ring and the cache.

Heavy imports (onnxruntime, tensorrt, pycuda) happen inside the modules that use them.
"""
