"""luminal_num: a numerics-aware, precision-searching tensor compiler."""

__version__ = "0.1.0"
