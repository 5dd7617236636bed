"""Dynamic loss scaling for fp16 (the rules of ``torch.amp.GradScaler``).

The loss is multiplied by ``scale`` before backward; gradients are divided by it before the
update. If any gradient element on any rank is inf or NaN the step is skipped on every rank
and the scale backs off; after ``growth_interval`` good steps in a row it grows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    skipped_steps: int = 0

    def update(self, found_inf: bool) -> None:
        """Record a step's outcome: back off on overflow, grow after enough good steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor
