"""luminal_num: a numerics-aware, precision-searching tensor compiler."""
