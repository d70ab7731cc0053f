"""Layer 7, the tools: tuning runs (:mod:`~.tuning`), throughput sweeps
(:mod:`~.bench`), plots (:mod:`~.plot`), the demo (:mod:`~.demo`), named shape
sets (:mod:`~.shapes`) and the command line (:mod:`~.cli`). Each imports the
library below it; nothing below imports a tool."""
