"""deploy/Dockerfile.cpu and .cuda, parsed by Docker's own parser (the `dockerfile` package wraps
moby/buildkit's): multi-stage, the final stage runs as the chart's non-root UID, a healthcheck on
/health, `strata` as the entrypoint. Building them needs a Docker daemon and the registries'
base images, which this machine has not: the README gives the commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.manifests import chart_defaults

dockerfile = pytest.importorskip("dockerfile", reason="the `dockerfile` parser is not installed (dev extra)")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _stages(path: Path) -> list[list]:
    stages: list[list] = []
    for c in dockerfile.parse_file(str(path)):
        if c.cmd == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(c)
    return stages


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_dockerfile_policies(kind) -> None:
    path = DEPLOY / f"Dockerfile.{kind}"
    stages = _stages(path)
    assert len(stages) == 2 and stages[0][0].value[-2:] == ("AS", "build")  # multi-stage
    final = stages[-1]
    cmds = [c.cmd for c in final]
    assert cmds.count("USER") == 1 and cmds.index("USER") > max(i for i, c in enumerate(cmds) if c == "RUN")
    uid = next(c for c in final if c.cmd == "USER").value[0].split(":")[0]
    assert uid == str(chart_defaults()["securityContext"]["runAsUser"])  # runAsNonRoot can check a numeric UID
    copy = [c for c in final if c.cmd == "COPY"]
    assert copy and all("--from=build" in c.flags for c in copy)  # nothing from the build context in the final image
    health = next(c for c in final if c.cmd == "HEALTHCHECK")
    assert "/health" in " ".join(health.value)
    assert next(c for c in final if c.cmd == "ENTRYPOINT").value == ("strata",)
    env = {}
    for c in final:
        if c.cmd == "ENV":
            env.update(zip(c.value[::2], c.value[1::2]))
    assert env["HOME"] == "/tmp" and env["STRATA_CACHE"].startswith("/cache/")  # the chart's writable mounts
    build = " ".join(" ".join(c.value) for c in stages[0] if c.cmd in ("RUN", "ARG"))
    assert ("whl/cpu" in build) == (kind == "cpu") and ("whl/cu1" in build) == (kind == "cuda")
