"""What a model is for, in pure numpy: card-driven preprocessing, classification scores, detection
decoding + NMS, raw tensors, and one answer shape per task (:class:`TaskDecoder`)."""

from .decoder import TaskDecoder
from .classification import probabilities, softmax, top_k
from .detection import Detections, decode, nms
from .preprocess import Geometry, Preprocess
from .tensor import decode_output, encode_outputs

__all__ = ["Detections", "Geometry", "Preprocess", "TaskDecoder", "decode", "decode_output", "encode_outputs", "nms",
           "probabilities", "softmax", "top_k"]
