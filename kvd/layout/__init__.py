"""The page-format algebra: formats as data (``formats``), what an attached tensor's shape means
(``geometry``), and the one planner that turns a pair of formats into byte moves (``planner``).

Pure logic, no torch: ``kvd.kernels`` executes the plans.
"""
