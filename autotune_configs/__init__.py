"""Shipped tuned kernel configs, one folder per GPU (installed as ``sparse24.autotune_configs``)."""
