"""Op costs: estimated from FLOPs and bytes (``estimate``), measured on a device
(``profile``), and link speeds fitted from timed copies and collectives (``links``)."""

from __future__ import annotations

from autoplace.costs.estimate import estimate_costs, op_cost

__all__ = ["estimate_costs", "op_cost"]
