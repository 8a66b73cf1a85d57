"""The learner library: wrap any torch model and inner optimizer as a Decoupled DiLoCo learner.

from learner import Learner
learner = Learner(model, opt, synchronizer="host:50051", sync_every=100, fragments=4, codec="int4")
...  loss.backward(); learner.step(tokens=n, loss=loss.item()); opt.zero_grad()
learner.finish()
"""

from learner.config import LearnerConfig
from learner.learner import Learner
from learner.stats import LearnerStats

__all__ = ["Learner", "LearnerConfig", "LearnerStats"]
