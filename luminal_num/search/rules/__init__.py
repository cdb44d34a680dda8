"""egglog rulesets, one module per phase. Each rule carries a one-line reason why it is sound."""
