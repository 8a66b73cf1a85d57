"""The README's "Training your own model" example, run as written (only the Synchronizer's
address replaced by a real one on port 0): it trains, syncs and leaves."""

from __future__ import annotations

import re
from typing import Any

from tests.helpers import REPO

ADDRESS = "127.0.0.1:50051"


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Training your own model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the README's 'Training your own model' section has no python block"
    return blocks[0]


def test_the_readme_example_trains_syncs_and_leaves_as_written(make_server: Any) -> None:
    srv = make_server()  # the service's defaults, as `diloco-synchronizer serve` starts
    code = readme_example()
    assert ADDRESS in code
    scope: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(code.replace(ADDRESS, srv.address), "README.md", "exec"), scope)  # noqa: S102
    learner = scope["learner"]
    stats = learner.stats
    assert stats.step == 300 and stats.sync_state == "closed"
    assert stats.pushes.get("accepted", 0) > 0, stats.pushes
    status = srv.synchronizer.status()
    assert [r.state for r in status.learners] == ["left"]
    assert sum(v.version for v in status.versions) > 0  # its pushes were merged
