"""Bring your own model: ONNX files imported onto the GraphTensor frontend (see importer.py, ops.py)."""
from .importer import IOSpec, OnnxModel, import_model
from .loader import LoadedModel, OnnxImportError, load_file, load_proto, parse_shapes

__all__ = ["IOSpec", "LoadedModel", "OnnxImportError", "OnnxModel", "import_model", "load_file", "load_proto",
           "parse_shapes"]
