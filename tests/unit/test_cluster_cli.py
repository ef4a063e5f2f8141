"""`btb-lab router` / `btb-lab model` command surface and the backend's user errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from btb_lab.cli import app
from btb_lab.cluster.backend import resolve_served_model, resolve_vocab_size
from btb_lab.config.hypothesis import Hypothesis
from btb_lab.errors import UserError, ValidationFailed
from btb_lab.hypothesis.loader import load_hypothesis

ROOT = Path(__file__).resolve().parents[2]


def hyp(launch: dict[str, object], model: object = "llama-3.3-70b") -> Hypothesis:
    return Hypothesis.model_validate(
        {
            "id": "x", "title": "t", "claim": "c", "backend": "cluster", "model": model,
            "cluster": {"launch": launch},
            "workload": {"generator": {"kind": "poisson"}},
            "variants": {"a": {"router": {"policy": "least_load"}}},
            "baseline": "a", "verdict": {"metric": "ttft_p50"},
        }
    )  # fmt: skip


def test_help_lists_the_commands() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["router", "--help"])
    assert result.exit_code == 0
    assert "serve" in result.output
    assert "bench" in result.output
    result = runner.invoke(app, ["model", "make-tiny", "--help"])
    assert result.exit_code == 0
    assert "tiny random-weight Llama" in result.output


def test_serve_unknown_variant_is_a_user_error() -> None:
    result = CliRunner().invoke(
        app,
        ["router", "serve", "--hypothesis", str(ROOT / "hypotheses" / "cpu-smoke.yaml"),
         "--variant", "nope"],
    )  # fmt: skip
    assert isinstance(result.exception, UserError)
    assert "no variant 'nope'" in str(result.exception)
    assert "least_load, cache_aware" in str(result.exception)


def test_served_model_required_and_env_expanded(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError, match=r"cluster\.launch\.served_model: required"):
        resolve_served_model(hyp({}))
    monkeypatch.setenv("BTB_TEST_MODEL", "org/small-model")
    assert resolve_served_model(hyp({"served_model": "${BTB_TEST_MODEL}"})) == "org/small-model"
    monkeypatch.delenv("BTB_TEST_MODEL")
    with pytest.raises(UserError, match="unset variable"):
        resolve_served_model(hyp({"served_model": "${BTB_TEST_MODEL}"}))


def test_vocab_size_from_local_model_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"vocab_size": 777}')
    assert resolve_vocab_size(hyp({}), str(tmp_path)) == 777
    assert resolve_vocab_size(hyp({"vocab_size": 99}), str(tmp_path)) == 99
    assert resolve_vocab_size(hyp({}), "org/remote") == 32_000


def test_validation_refuses_a_cluster_hypothesis_with_no_served_checkpoint(
    tmp_path: Path,
) -> None:
    # caught by `validate`, not first by `run` or `router serve` after servers are planned
    text = (
        "id: c\ntitle: t\nclaim: c\nbackend: cluster\n"
        "workload:\n  generator: {kind: poisson}\n"
        "variants:\n  a: {router: {policy: least_load}}\nbaseline: a\n"
        "verdict: {metric: ttft_p50}\ncluster:\n  launch: {host: 127.0.0.1}\n"
    )
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValidationFailed) as info:
        load_hypothesis(path)
    assert info.value.problems == [
        (
            f"{path}:12: cluster.launch.served_model: required for the cluster backend (a "
            "Hugging Face name or a local model folder); the model preset 'llama-3.3-70b' "
            "names no served checkpoint"
        )
    ]
    load_hypothesis(path, {"cluster.launch.served_model": "org/small"})
    # the simulator needs no checkpoint, but the default instance (1×H100) cannot hold the
    # preset's weights: said at validation too
    with pytest.raises(ValidationFailed, match="does not fit") as sim:
        load_hypothesis(path, {"backend": "sim"})
    assert not any("served_model" in problem for problem in sim.value.problems)


def test_the_router_warns_only_when_it_listens_beyond_this_machine() -> None:
    import socket

    from btb_lab.cli.cluster import _listen, _loopback
    from btb_lab.cluster.launcher import free_port, http_url

    for host, loopback in [("127.0.0.1", True), ("localhost", True), ("0.0.0.0", False)]:
        with _listen(host, 0) as sock:
            assert _loopback(sock) is loopback, host
    if socket.has_ipv6:
        with _listen("::1", 0) as sock:
            assert _loopback(sock)
        assert free_port("::1") > 0  # instances on an IPv6 loopback get ports too
    assert http_url("::1", 8000) == "http://[::1]:8000"
    assert http_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"


@pytest.mark.parametrize(
    ("endpoints", "expected"),
    [
        ("['http://127.0.0.1:9']",
         "launch.endpoints lists 1 servers for the 2 instances of cluster.instances"),
        ("['127.0.0.1:9', 'http://127.0.0.1:10']", "endpoint 0 '127.0.0.1:9': give http://"),
        ("['ftp://h:9', 'http://h:10']", "endpoint 0 'ftp://h:9': give http://HOST:PORT"),
        ("['http://h:99999', 'http://h:10']", "endpoint 0 'http://h:99999': Port out of range"),
        ("['http://h:9/v1', 'http://h:10']", "give the server's root, without '/v1'"),
    ],
)  # fmt: skip
def test_endpoints_that_cannot_be_the_instances_are_refused(
    tmp_path: Path, endpoints: str, expected: str
) -> None:
    """They ran: every request failed (exit 0), or a 1×PS + 2×C cluster became E0, E1 of
    role C with no offload while its report still said 1×PS + 2×C."""
    text = (
        "id: c\ntitle: t\nclaim: c\nbackend: cluster\n"
        "workload:\n  generator: {kind: poisson}\n"
        "variants:\n  a: {router: {policy: least_load}}\nbaseline: a\n"
        "verdict: {metric: ttft_p50}\ncluster:\n  instances: [{role: C, count: 2}]\n"
        f"  launch: {{served_model: m, endpoints: {endpoints}}}\n"
    )
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValidationFailed) as info:
        load_hypothesis(path)
    assert any(expected in problem for problem in info.value.problems), info.value.problems
