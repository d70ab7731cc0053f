"""Layer 4: ops. Launchers, the registered ``sparse24::linear`` op, its
pure-torch twin and the backend choice (:mod:`~sparse24.ops.linear24`), and the
tile configs the launches read: the config space (:mod:`~.config_space`) and
the per-GPU tuned-config store (:mod:`~.config_store`)."""
