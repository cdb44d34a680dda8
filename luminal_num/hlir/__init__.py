"""HLIR: primops, graph, views, GraphTensor frontend and the FP64/FP32 reference evaluator."""
from .evaluate import evaluate, evaluate_nodes
from .graph import Graph, InputInfo, Node, Source
from .ops import BINARY_OPS, CUSTOM_KINDS, ELEMENTWISE_OPS, REDUCE_OPS, UNARY_OPS, Group, Op, OpDecl
from .shape import ShapeTracker, View
from .symbolic import Dim, Poly, sym
from .tensor import GraphTensor, concat, embedding, index_input

__all__ = ["evaluate", "evaluate_nodes", "Graph", "InputInfo", "Node", "Source", "Op", "OpDecl", "Group",
           "UNARY_OPS", "BINARY_OPS", "ELEMENTWISE_OPS", "REDUCE_OPS", "CUSTOM_KINDS", "ShapeTracker", "View",
           "Dim", "Poly", "sym", "GraphTensor", "concat", "embedding", "index_input"]
