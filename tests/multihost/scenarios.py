"""Two simulated hosts under ``torchrun --nnodes 2 --nproc-per-node 2``: scenarios and checks.

The driver side of the multi-host tests (the rank side is
:mod:`tests.multihost.ranks`). Each scenario builds :class:`~tests.multihost.
netns.TwoHosts`, starts ``torchrun`` as each host (node rank 0 on host ``a``,
whose veth address is ``MASTER_ADDR``), waits for the ranks' result files,
takes the hosts down and returns what happened; the ``check_*`` functions turn
that into a list of problems (empty: pass). The ranks' environment carries no
``GROUPCOORD_NODE_ID`` and no ``GROUPCOORD_HOST_IP``: which ranks share a host
and which address remote readers connect to is the library's to find out.

Command line (the script CI's pytest wrapper also drives; needs root)::

    python -m tests.multihost.scenarios                 # the CI selection
    python -m tests.multihost.scenarios --all           # plus the slow cases
    python -m tests.multihost.scenarios --case fault-tp-link --timeout 5

It prints one line per case with its numbers and exits 0 when every case
passed.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.multihost.netns import (
    LaunchedHost,
    TwoHosts,
    sweep_stale,
    unavailable_reason,
    work_dir,
)

REPO = Path(__file__).resolve().parents[2]
MASTER_PORT = 29500
WORLD = 4
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                  "GROUPCOORD_NODE_ID", "GROUPCOORD_HOST_IP", "XDG_RUNTIME_DIR", "TMPDIR")


#: What torch itself leaves in /tmp (torchrun's scratch, the inductor cache).
_TORCH_TMP = ("torchelastic_", "torchinductor_")


@dataclass
class Run:
    """What one two-host launch produced.

    Attributes:
        results: ``results[case][rank]``: the rank's result file.
        status: Per host: the command's exit status inside the host (None
            when the driver had to kill the host first).
        shm_left: Per host: names left in its ``/dev/shm`` after the command
            (None when unknown, i.e. the host was killed).
        logs: Per host: the end of its output.
        events: Driver-side facts (link-down time, kill record, ...).
        wall_s: Seconds from launch to the end of the hosts.
    """

    results: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    status: dict[str, int | None] = field(default_factory=dict)
    shm_left: dict[str, list[str] | None] = field(default_factory=dict)
    tmp_left: dict[str, list[str]] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
    events: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    def rank(self, case: str, rank: int) -> dict[str, Any] | None:
        """One rank's result of ``case``, or None."""
        return self.results.get(case, {}).get(rank)

    def describe(self) -> str:
        """Statuses and log tails, for assertion messages."""
        parts = [f"status={self.status} shm_left={self.shm_left} events={self.events}"]
        parts += [f"--- host {k} log ---\n{v}" for k, v in self.logs.items()]
        return "\n".join(parts)


def torchrun_argv() -> list[str]:
    """``torchrun`` of this interpreter's environment."""
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def host_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment each host's torchrun starts with (no launcher or topology hints)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"})
    env.update(extra or {})
    return env


def _torchrun(hosts: TwoHosts, node_rank: int, prog: Sequence[str]) -> list[str]:
    return [*torchrun_argv(), "--nnodes", "2", "--nproc-per-node", "2",
            "--node-rank", str(node_rank), "--master-addr", hosts.hosts["a"].ip,
            "--master-port", str(MASTER_PORT), "--max-restarts", "0",
            "--monitor-interval", "0.2", *prog]


def _read_results(hosts: TwoHosts) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for h in hosts.hosts.values():
        for f in sorted(h.out.glob("*-rank*.json")) if h.out.is_dir() else []:
            m = re.fullmatch(r"(.+)-rank(\d+)\.json", f.name)
            if m:
                out.setdefault(m.group(1), {})[int(m.group(2))] = json.loads(f.read_text())
    return out


def launch_two_hosts(
    workdir: Path,
    prog: Sequence[str],
    *,
    limit_s: float,
    hostnames: Sequence[str] = ("gchost-a", "gchost-b"),
    env: dict[str, str] | None = None,
    done: Callable[[TwoHosts], bool] | None = None,
    tick: Callable[[TwoHosts, Run], None] | None = None,
    grace_s: float = 8.0,
) -> Run:
    """Run ``prog`` under torchrun on both hosts; collect results; tear everything down.

    Args:
        workdir: Fresh directory for the hosts' files.
        prog: What torchrun runs (``["-m", "module", ...]``).
        limit_s: Hard bound of the whole launch (then every process is killed).
        hostnames: The hosts' names.
        env: Extra environment of both hosts.
        done: Called while waiting; once True, the hosts get ``grace_s`` more
            seconds to exit on their own before they are killed.
        tick: Called about every 50 ms while waiting (fault injection).
        grace_s: See ``done``.
    """
    sweep_stale()
    run = Run()
    t0 = time.monotonic()
    with TwoHosts(workdir, hostnames) as hosts:
        launched = [hosts.launch(k, _torchrun(hosts, i, prog), host_env(env), limit_s,
                                 cwd=str(REPO)) for i, k in enumerate(("a", "b"))]
        _wait(hosts, launched, run, t0 + limit_s + 10, done, tick, grace_s)
        run.wall_s = time.monotonic() - t0
        for lh in launched:
            k = lh.host.key
            lh.kill()
            run.status[k] = lh.command_status()
            run.shm_left[k] = lh.shm_left()
            # torchrun's scratch and torch's compile cache are not ours to remove
            run.tmp_left[k] = sorted(p.name for p in lh.host.tmp.iterdir()
                                     if p.name not in ("out", "rc", "shm-left", *hosts.kept_tmp)
                                     and not p.name.startswith(_TORCH_TMP))
            run.logs[k] = lh.log_tail()
        run.results = _read_results(hosts)
    return run


def _wait(hosts: TwoHosts, launched: list[LaunchedHost], run: Run, deadline: float,
          done: Callable[[TwoHosts], bool] | None,
          tick: Callable[[TwoHosts, Run], None] | None, grace_s: float) -> None:
    while time.monotonic() < deadline:
        if all(lh.proc.poll() is not None for lh in launched):
            return
        if tick is not None:
            tick(hosts, run)
        if done is not None and done(hosts):
            deadline = min(deadline, time.monotonic() + grace_s)
            done = None
        time.sleep(0.05)
    run.events["killed_at_deadline"] = [lh.host.key for lh in launched
                                        if lh.proc.poll() is None]


def _files_present(names: Sequence[tuple[str, str]]) -> Callable[[TwoHosts], bool]:
    return lambda hosts: all((hosts.hosts[k].out / n).exists() for k, n in names)


# ---------------------------------------------------------------- healthy cases
def run_healthy(workdir: Path, hostnames: Sequence[str] = ("gchost-a", "gchost-b"),
                timeout: float = 60.0, cases: Sequence[str] = ("tp", "pp")) -> Run:
    """TP across the hosts, then TP inside / PP across, in one launch."""
    prog = ["-m", "tests.multihost.ranks", "--timeout", str(timeout)]
    for case in cases:
        prog += ["--case", case]
    return launch_two_hosts(workdir, prog, limit_s=timeout + 60, hostnames=hostnames)


def check_healthy(run: Run, hostnames: Sequence[str] = ("gchost-a", "gchost-b"),
                  cases: Sequence[str] = ("tp", "pp")) -> list[str]:
    """Problems of a healthy run (empty when it passed)."""
    p: list[str] = []
    for case in cases:
        missing = [r for r in range(WORLD) if run.rank(case, r) is None]
        if missing:
            p.append(f"case {case}: no result from ranks {missing}")
    if p:
        return p + [run.describe()[-3000:]]
    if "tp" in cases:
        p += _check_tp(run, hostnames)
    if "pp" in cases:
        p += _check_pp(run)
    p += _check_clean(run)
    return p


def _check_tp(run: Run, hostnames: Sequence[str]) -> list[str]:
    p: list[str] = []
    res = [run.rank("tp", r) for r in range(WORLD)]
    local = [True, True, False, False]
    for r, x in enumerate(res):
        assert x is not None
        want_host = hostnames[r // 2]
        want_ip = f"10.213.0.{r // 2 + 1}"
        facts = {
            "hostname": (x["hostname"], want_host),
            "same_node": (x["same_node"], local),
            "nodes": (x["nodes"], [0, 0, 1, 1]),
            "host_ip": (x["host_ip"], want_ip),
            "comm_mode": (x["comm_mode"], "hierarchical"),
            "mq_transport": (x["mq_transport"],
                             "writer" if r == 0 else ("shm" if local[r] else "tcp")),
            "node_id_env": (x["node_id_env"], None),
            "host_ip_env": (x["host_ip_env"], None),
        }
        p += [f"tp rank {r}: {k} = {got!r}, expected {want!r}"
              for k, (got, want) in facts.items() if got != want]
        for k in ("tensor_dict_ok", "all_reduce_int_ok", "all_reduce_max_ok",
                  "all_reduce_big_ok", "all_gather_ok", "reduce_scatter_ok", "object_ok"):
            if x[k] is not True:
                p.append(f"tp rank {r}: {k} is {x[k]!r}")
        if not x["all_reduce_float_err"] < 1e-5:
            p.append(f"tp rank {r}: float all-reduce error {x['all_reduce_float_err']}")
        if x["object_host"] != hostnames[1]:
            p.append(f"tp rank {r}: broadcast object came from {x['object_host']!r}")
    if len({x["all_reduce_float_bits"] for x in res if x}) != 1:
        p.append("tp: ranks hold different float all-reduce results")
    r0 = res[0]
    assert r0 is not None
    if not str(r0["remote_pub"]).startswith("tcp://10.213.0.1:"):
        p.append(f"tp: remote readers connect to {r0['remote_pub']!r}, not host a's veth address")
    if not r0["curve_server_key"] or r0["handle_client_secret"]:
        p.append("tp: the TCP endpoints are not CURVE servers with per-reader keys")
    if not r0["results_ok"] or r0["result_transports"] != {"1": "shm", "2": "tcp", "3": "tcp"}:
        p.append(f"tp: results to rank 0: ok={r0['results_ok']} "
                 f"transports={r0['result_transports']}")
    if any(r0["security_stats"].values()):
        p.append(f"tp: the writer refused connections: {r0['security_stats']}")
    return p


def _check_pp(run: Run) -> list[str]:
    p: list[str] = []
    for r in range(WORLD):
        x = run.rank("pp", r)
        assert x is not None
        facts = {"tp_same_node": (x["tp_same_node"], [True, True]),
                 "pp_same_node": (x["pp_same_node"], [True, False]),
                 "tp_comm_mode": (x["tp_comm_mode"], "shm"),
                 "pp_comm_mode": (x["pp_comm_mode"], "gloo"),
                 "tp_mq_transport": (x["tp_mq_transport"], "writer" if r % 2 == 0 else "shm")}
        p += [f"pp rank {r}: {k} = {got!r}, expected {want!r}"
              for k, (got, want) in facts.items() if got != want]
        for k in ("pp_tensor_dicts_ok", "pp_send_recv_ok", "tp_all_reduce_ok"):
            if x[k] is not True:
                p.append(f"pp rank {r}: {k} is {x[k]!r}")
    return p


def _check_clean(run: Run, hosts: Sequence[str] = ("a", "b")) -> list[str]:
    """Every command exited 0 and left no segment or channel directory on its host."""
    p = []
    for k in hosts:
        if run.status.get(k) != 0:
            p.append(f"host {k}: torchrun exited with {run.status.get(k)}")
        if run.shm_left.get(k):
            p.append(f"host {k}: /dev/shm still holds {run.shm_left[k]}")
        if run.tmp_left.get(k):
            p.append(f"host {k}: /tmp still holds {run.tmp_left[k]}")
    return p


# ---------------------------------------------------------------- the demo
def run_demo_two_hosts(workdir: Path, timeout: float = 120.0, tp: int = 2,
                       pp: int = 2) -> tuple[Run, dict[str, Any] | None]:
    """``groupcoord demo --launcher env`` at TP x PP (4 ranks) over the two hosts."""
    prog = ["-m", "coordinator", "demo", "--launcher", "env", "--tp", str(tp), "--pp", str(pp),
            "--no-progress", "--timeout", str(timeout), "--json", "/tmp/out/demo.json"]
    run = launch_two_hosts(workdir, prog, limit_s=timeout + 60)
    path = workdir / "a" / "tmp" / "out" / "demo.json"
    return run, json.loads(path.read_text()) if path.exists() else None


def run_demo_one_host(workdir: Path, timeout: float = 120.0, tp: int = 2,
                      pp: int = 2) -> dict[str, Any] | None:
    """The default ``groupcoord demo`` (it starts its ranks itself) on this machine."""
    path = workdir / "one-host-demo.json"
    env = host_env()
    proc = subprocess.run([sys.executable, "-m", "coordinator", "demo", "--tp", str(tp),
                           "--pp", str(pp),
                           "--no-progress", "--timeout", str(timeout), "--json", str(path)],
                          capture_output=True, text=True, timeout=timeout + 60, env=env,
                          cwd=str(REPO))
    if proc.returncode != 0:
        raise RuntimeError(f"one-host demo failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"\n{proc.stderr[-2000:]}")
    return json.loads(path.read_text())


def check_demo(run: Run, two: dict[str, Any] | None, one: dict[str, Any] | None,
               tp: int = 2, pp: int = 2, bitwise: bool = True) -> list[str]:
    """The two-host demo verified, and equal to the one-host demo.

    ``bitwise``: the logits must be bit-identical too. True when TP stays inside
    each host (the same shared-memory all-reduce as on one host); a TP group
    across the hosts sums in another order (hierarchical: per host, then
    between hosts), so only the tokens and the reference check must agree.
    """
    if two is None:
        return ["the two-host demo wrote no JSON"]
    p = _check_clean(run)
    if not two["verified"] or two["launcher"] != "env" or (two["tp"], two["pp"]) != (tp, pp):
        p.append(f"two-host demo: verified={two['verified']} launcher={two['launcher']}")
    if "PASS" not in run.logs.get("a", ""):
        p.append("two-host demo: rank 0 printed no PASS")
    if one is not None:
        if two["generated"] != one["generated"]:
            p.append("two-host demo generated other tokens than the one-host demo")
        if bitwise and two["logits_sha256"] != one["logits_sha256"]:
            p.append("two-host demo logits are not bit-identical to the one-host demo's")
    return p


# ---------------------------------------------------------------- faults
@dataclass(frozen=True)
class Fault:
    """Where a fault lands: rank ``victim``, right before ``op`` of step ``step``.

    ``kind`` ``kill``: the victim SIGKILLs itself. ``link``: the victim holds
    back while the driver takes host b's end of the veth down, then goes on
    into ``op`` (its peers are already waiting in it).
    """

    workload: str
    kind: str
    victim: int
    op: str
    step: int = 5

    def survivors(self) -> list[int]:
        """Ranks that must raise: all for a link fault; for a kill, those on the
        other host (torchrun's agent stops the victim's host-mate itself)."""
        if self.kind == "link":
            return list(range(WORLD))
        return [r for r in range(WORLD) if r // 2 != self.victim // 2]


def run_fault(workdir: Path, fault: Fault, timeout: float = 5.0) -> Run:
    """The step loop of ``fault.workload`` until ``fault`` lands."""
    prog = ["-m", "tests.multihost.ranks", "--case", "fault", "--workload", fault.workload,
            "--fault", fault.kind, "--timeout", str(timeout), "--victim", str(fault.victim),
            "--at-op", fault.op, "--at-step", str(fault.step)]
    names = [("a" if r < 2 else "b", f"fault-rank{r}.json") for r in fault.survivors()]
    victim_out = workdir / ("a" if fault.victim < 2 else "b") / "tmp" / "out"

    def tick(hosts: TwoHosts, run: Run) -> None:
        if fault.kind == "link" and "t_fault" not in run.events \
                and (victim_out / "holding").exists():
            run.events["t_fault"] = hosts.set_link("b", up=False)
            (victim_out / "link-down").write_text("")

    # torchrun's agents cannot agree on anything once the link is down: give
    # the hosts 3 s after the survivors' reports, then take them down
    run = launch_two_hosts(workdir, prog, limit_s=timeout * 6 + 60,
                           done=_files_present(names), tick=tick, grace_s=3.0)
    if fault.kind == "kill":
        with contextlib.suppress(OSError, ValueError):
            run.events["t_fault"] = json.loads((victim_out / "kill").read_text())["t"]
    return run


_ERROR_BASES = ("CommTimeout", "PeerDiedError", "ClosedError", "CollectiveMismatch")


def check_fault(run: Run, fault: Fault, timeout: float,
                slack_s: float = 2.0) -> tuple[list[str], dict[int, float]]:
    """Every surviving rank raised one of ours, naming op and peer, within timeout + slack.

    Returns:
        The problems, and each reporting rank's detection time (seconds from
        the fault to its error).
    """
    p: list[str] = []
    times: dict[int, float] = {}
    t_fault = run.events.get("t_fault")
    if t_fault is None:
        return ["the fault was never injected"], times
    for r in range(WORLD):
        x = run.rank("fault", r)
        if x is None:
            if r in fault.survivors():
                p.append(f"rank {r}: no result (it must survive and raise)")
            continue
        if x["outcome"] != "raised":
            p.append(f"rank {r}: outcome {x['outcome']} (op {x.get('op')})")
            continue
        dt = x["t_raise"] - t_fault
        times[r] = round(dt, 2)
        msg = x["message"]
        if not any(b in x["error_mro"] for b in _ERROR_BASES):
            p.append(f"rank {r}: raised {x['error_type']} (not one of ours): {msg[:300]}")
        if not dt <= timeout + slack_s:
            p.append(f"rank {r}: raised {dt:.2f} s after the fault (> {timeout} + {slack_s} s)")
        if not _names_op(msg, x["op"]):
            p.append(f"rank {r}: the error does not name the op {x['op']!r}: {msg[:300]}")
        if not re.search(r"rank|writer|reader|peer", msg):
            p.append(f"rank {r}: the error names no peer: {msg[:300]}")
        if x.get("cleanup") != "ok":
            p.append(f"rank {r}: leaving the groups after the error: {x.get('cleanup')}")
    return p, times


#: What an op may be called in an error: the coordinator's name, or the layer below's.
#: A queue error inside ``broadcast_tensor_dict`` names the group's broadcast queue
#: (``'tp:0-mq'``) and the message number, not the coordinator op.
_OP_ALIASES = {
    "broadcast_tensor_dict": ("broadcast_tensor_dict", "dequeue", "enqueue", "broadcast",
                              "-mq'"),
    "all_reduce": ("all_reduce", "allreduce"),
    "send_tensor_dict": ("send_tensor_dict", "send"),
    "recv_tensor_dict": ("recv_tensor_dict", "recv"),
}


def _names_op(msg: str, op: str) -> bool:
    return any(a in msg for a in _OP_ALIASES.get(op, (op,)))


# ---------------------------------------------------------------- command line
#: The fault cases by name: (workload, kind, victim, op).
FAULTS = {
    # TP over both hosts; rank 3 (host b) dies as the others enter all_reduce:
    # host a's ranks must raise (hierarchical all-reduce, gloo between leaders).
    "fault-tp-kill": Fault("tp", "kill", 3, "all_reduce"),
    # the TP queue's writer, rank 0 (host a), dies before a broadcast: host b's
    # TCP readers must raise.
    "fault-tp-kill-writer": Fault("tp", "kill", 0, "broadcast_tensor_dict"),
    # the link drops while ranks 1-3 wait for rank 0's broadcast: every rank raises.
    "fault-tp-link": Fault("tp", "link", 0, "broadcast_tensor_dict"),
    # the link drops while ranks 0, 1, 3 wait in all_reduce for rank 2.
    "fault-tp-link-all-reduce": Fault("tp", "link", 2, "all_reduce"),
    # PP across the hosts: stage 1's rank 2 dies before receiving.
    "fault-pp-kill": Fault("pp", "kill", 2, "recv_tensor_dict"),
    # the link drops while stage 1 waits for stage 0's tensor dict.
    "fault-pp-link": Fault("pp", "link", 0, "send_tensor_dict"),
}
CI_CASES = ("healthy", "same-hostname", "demo", "fault-tp-kill", "fault-tp-link")
SLOW_CASES = ("demo-tp4", "fault-tp-kill-writer", "fault-tp-link-all-reduce", "fault-pp-kill",
              "fault-pp-link")


def run_case(name: str, workdir: Path, timeout: float) -> tuple[list[str], dict[str, Any]]:
    """Run one named case; its problems and numbers."""
    if name == "healthy":
        run = run_healthy(workdir)
        return check_healthy(run), {"wall_s": round(run.wall_s, 1)}
    if name == "same-hostname":
        names, cases = ("gcnode", "gcnode"), ("tp",)
        run = run_healthy(workdir, names, cases=cases)
        return check_healthy(run, names, cases), {"wall_s": round(run.wall_s, 1)}
    if name in ("demo", "demo-tp4"):
        tp, pp = (2, 2) if name == "demo" else (4, 1)
        run, two = run_demo_two_hosts(workdir / "two", tp=tp, pp=pp)
        one = run_demo_one_host(workdir, tp=tp, pp=pp)
        nums: dict[str, Any] = {"wall_s": round(run.wall_s, 1)}
        if two and one:
            nums.update(tokens_per_s=round(two["tokens_per_s"], 1),
                        max_logit_diff=two["max_logit_diff"],
                        bit_identical=two["logits_sha256"] == one["logits_sha256"])
        return check_demo(run, two, one, tp, pp, bitwise=name == "demo"), nums
    if name not in FAULTS:
        raise ValueError(f"unknown case {name!r}; known: {CI_CASES + SLOW_CASES}")
    fault = FAULTS[name]
    run = run_fault(workdir, fault, timeout)
    problems, times = check_fault(run, fault, timeout)
    errs = {r: (x.get("error_type"), x.get("op")) for r, x in run.results.get("fault", {}).items()}
    return problems, {"detect_s": times, "errors": errs, "wall_s": round(run.wall_s, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected cases and print one line each; 0 when all passed."""
    ap = argparse.ArgumentParser(prog="python -m tests.multihost.scenarios")
    ap.add_argument("--case", action="append", choices=CI_CASES + SLOW_CASES)
    ap.add_argument("--all", action="store_true", help="the CI cases and the slow ones")
    ap.add_argument("--timeout", type=float, default=5.0, help="groups' timeout of fault cases")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    a = ap.parse_args(argv)
    # SIGTERM/SIGHUP unwind like an exception, so every host is taken down
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    # SIGUSR1 prints every thread's stack to stderr (a test's view of a stuck driver)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    reason = unavailable_reason()
    if reason:
        print(f"two-host simulation unavailable: {reason}")
        return 77
    cases = a.case or list(CI_CASES + (SLOW_CASES if a.all else ()))
    sweep_stale()
    work = work_dir()
    failed = 0
    try:
        for name in cases:
            t = time.monotonic()
            try:
                problems, nums = run_case(name, work / name, a.timeout)
            except Exception as e:  # report and go on with the next case
                problems, nums = [f"{type(e).__name__}: {e}"], {}
            failed += bool(problems)
            print(f"{'PASS' if not problems else 'FAIL'} {name} ({time.monotonic() - t:.1f} s) "
                  f"{json.dumps(nums)}", flush=True)
            for line in problems:
                print(f"    {line}")
    finally:
        if a.keep:  # renamed: a kept directory is not swept as a dead driver's
            kept = work.with_name(work.name.replace("gcmh-", "gcmh-kept-", 1))
            work.rename(kept)
            print(f"work directory: {kept}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
