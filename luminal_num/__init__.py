"""luminal_num: a numerics-aware, precision-searching tensor compiler.

Layering (the compiler's rewrite boundary; tests/test_layering.py enforces it): stages import one
way, hlir -> search (e-graph, choice space, extraction, lowering of chosen e-nodes, genome search,
plans) -> codegen (LLIR: kernel kinds declared once in codegen/kinds.py, `llir.verify`, serialization)
-> runtime (CPU and CUDA backends, cost model). `error` judges Programs from the side and never
imports search (the search hands it a chunk-lowering function); nothing below the LLIR imports search;
plans never import reports (both write through luminal_num.files). Every choice is made in the
e-graph: lowering translates, it does not decide. No module cycles, and no import moved into a
function to hide one.
"""

__version__ = "0.1.0"
