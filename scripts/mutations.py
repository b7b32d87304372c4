#!/usr/bin/env python3
"""Switch each safety rule off, one at a time, and show which tests notice.

``docs/safety.md`` says which tests catch a broken safety rule. This script measures it: for
each mutation below it copies ``gpuguard/``, ``tests/``, ``manifests/`` and ``pyproject.toml`` as
committed at ``HEAD`` (``git archive``; ``--worktree``: the working tree's files, uncommitted
changes included) into a fresh temporary directory (the working tree is never touched), switches the
one rule off there by exact text substitutions (each must match exactly once in its file, else
the script stops: the code moved and the mutation must be rewritten), and runs each named test
target in that copy::

    python -m pytest -x -q -p no:cacheprovider <target>   # cwd and PYTHONPATH: the copy

(``TESTBIN_DIR`` defaults to this checkout's ``testbin/bin``: the API-server tests find their
binaries there, which the copy lacks.)

A target that fails *killed* the mutation, one that passes let it *survive*. A claim is held to
more: it is *caught* only when the run's failures (pytest's ``FAILED``/``ERROR`` summary lines)
include it. A claim that names a file is caught by a failure of a test in that file; one that
names a test ID by a failure of that test (or of one of its parametrizations), never by another
test of its file. A claim may name a test inside a target file: that target then runs without
``-x``, so an earlier failure elsewhere in the file cannot hide it. Every target is
first run once on an unmutated copy: a target that fails there makes every verdict meaningless
and the script stops. The Hypothesis database lives in the copy, so nothing found by an earlier
run is replayed; the stateful model draws fresh examples each run unless ``--hypothesis-seed``
fixes them. Unless ``--shrink`` is given, the copy's ``tests/conftest.py`` gets a Hypothesis
profile without the shrink phase (appended, the one change to a test file): the question is
whether and how soon a test fails, not the smallest failing example, and shrinking a stateful
failure can take minutes. The seconds printed are the whole pytest run, collection included.

``claimed`` is what ``docs/safety.md`` says catches each mutation. The exit status is 1 when a
claim does not catch its mutation in any run (the doc would be false), 2 when a
substitution did not match exactly once or a baseline target failed, else 0. A target that
kills a mutation it is not claimed for is reported, never an error. ``--repeat N`` runs each
target N times (a fresh copy and fresh Hypothesis examples each time): the stateful model finds
some mutations in some runs only, and a claim must hold in every run.

Each run's pytest output (command, exit status, stdout, stderr) is kept, as
``<output dir>/<mutation or baseline>/run<k>-<target>.txt`` (``--output-dir``; default a fresh
temporary directory, printed first and last), so a verdict can be read back from the run that
gave it.

``DESELECTED`` names tests left out of every run, each with why (a test that fails without any
mutation would make every verdict on its target meaningless).

The kernel mutations need root and writable cgroup hierarchies (``tests/kernel``); without
them those targets skip, which the script reports as ``skipped`` (a claimed target that
skipped is an error: it proved nothing). The admission fence's mutation edits
``manifests/agent-admission-policy.yaml`` and needs the API-server binaries
(``scripts/ensure-testbin.sh``).

``make mutation-check`` (run by ``make test``) is the bounded form CI runs: ``--claimed-only``
(each mutation once, against the targets that claim it) with ``--jobs 2`` (copies run side by
side); it fails the build when a claimed target lets its mutation survive.

Usage::

    .venv/bin/python -m scripts.mutations [--only NAME ...] [--list] [--repeat N]
        [--claimed-only] [--jobs N] [--worktree] [--hypothesis-seed N] [--shrink]
        [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COPIED = (
    "gpuguard",
    "rigs",
    "tests",
    "benchmarks",
    "manifests",
    "pyproject.toml",
    "scripts/ensure-bpf.sh",
    "scripts/ensure-lib.sh",
)
"""What a copy holds: the product, its tests, the rigs they share and the benchmarks they run,
and the script that fetches the BPF tools the allocation guard's kernel tests build with."""
IGNORED = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache", "*.pyc")
RUN_TIMEOUT_S = 900

STATEFUL = "tests/test_policy_stateful.py"
POLICY = "tests/test_policy.py"
KERNEL_SIGNALS = "tests/kernel/test_signals.py"
FENCE = "tests/kube/test_admission_fence.py::test_the_agent_may_not_change_another_node"
FENCE_FORGED = (
    "tests/kube/test_admission_fence.py::"
    "test_forged_field_ownership_cannot_make_an_admins_unchanged_apply_remove_a_taint_or_label"
)
POLICY_DRA = "tests/test_policy_dra.py"
POLICY_CONTAINERS = "tests/test_policy_containers.py"
PIN_REUSE = "tests/kernel/test_pin_reuse.py"
KILLER_STUCK_MEMBER = "tests/kernel/test_killer_stuck_member.py"
FREEZE = "tests/test_freeze.py"
GUARD_SERVICE = "tests/kernel/test_allocguard_service.py"
GUARD_RESUME_VERIFIED = (
    f"{GUARD_SERVICE}::test_resume_refuses_a_stopped_process_not_as_read_when_frozen"
)
GUARD_KEPT = (
    f"{GUARD_SERVICE}::test_a_caller_is_kept_frozen_until_a_listing_after_its_freeze_then_the_bound"
)
OWNERSHIP_WATCHED = (
    "tests/integration/test_ownership.py::"
    "test_a_process_that_closes_its_gpu_files_while_watched_is_still_charged"
)

DESELECTED: dict[str, str] = {}
"""Test ID -> why it is left out of every run (none now: the shell-PID-1 test that was, flaky
on the 2-vCPU VM at ff09afa, was fixed in 99cd768)."""

UNCHARGEABLE = "    if pid in tainted or (attribution.holds_gpu is False and pid not in settled):\n"


@dataclass(frozen=True)
class Patch:
    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    rule: str
    patches: tuple[Patch, ...]
    targets: tuple[str, ...]
    claimed: tuple[str, ...]
    """What docs/safety.md says catches this mutation: test files or test IDs, each one a target
    or a test inside a target file (``judged_by``)."""


@dataclass
class Result:
    target: str
    verdict: str  # killed, survived, skipped
    seconds: float
    failed: list[str] = field(default_factory=list)
    """The IDs of the failing and erroring tests, as pytest's summary names them."""
    why: str = ""
    """The first failing assertion's message (pytest's first ``E`` line)."""
    output: Path | None = None
    """Where this run's pytest output is kept."""


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        name="taint-never-set",
        rule="taint rule: a PID whose occupant changed, or started after its first listing, "
        "is tainted (core/policy.py _track_identities)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "        if pid in state.tainted or changed or late:\n"
                "            tainted.add(pid)\n",
                "        if False:\n            tainted.add(pid)\n",
            ),
        ),
        targets=(STATEFUL, POLICY),
        claimed=(STATEFUL, POLICY),
    ),
    Mutation(
        name="taint-ignored-when-charging",
        rule="taint rule: a tainted PID is never charged (core/assess.py unchargeable)",
        patches=(
            Patch(
                "gpuguard/core/assess.py",
                UNCHARGEABLE,
                "    if attribution.holds_gpu is False and pid not in settled:\n",
            ),
        ),
        targets=(STATEFUL, POLICY),
        claimed=(STATEFUL, POLICY),
    ),
    Mutation(
        name="holds-gpu-check-off",
        rule="holds_gpu check: an occupant with no GPU file open (or its ghost) is charged only "
        "once its PID or its pod is settled (core/assess.py unchargeable)",
        patches=(
            Patch(
                "gpuguard/core/assess.py",
                UNCHARGEABLE,
                "    if pid in tainted:\n",
            ),
        ),
        targets=(STATEFUL, POLICY),
        claimed=(STATEFUL, POLICY),
    ),
    Mutation(
        name="ghost-never-settles",
        rule="a ghost settles like a live occupant and is charged to the pod its PID was last "
        "attributed to (core/policy.py _track_identities)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "        owner = attribution if identity is not None"
                " else state.remembered.get(pid)\n",
                "        owner = attribution if identity is not None else None\n",
            ),
        ),
        targets=(STATEFUL, POLICY),
        claimed=(STATEFUL, POLICY),
    ),
    Mutation(
        name="pod-settle-off",
        rule="the settle clock also runs per pod: a pod listed for owner_settle_seconds owns "
        "its untainted processes' listings (core/policy.py _track_identities)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "    settled.update(\n"
                "        pid for pid, uid in pod_of.items()"
                " if last_at[pid] - pods_listed[uid][0] >= settle\n"
                "    )\n",
                "",
            ),
        ),
        targets=(STATEFUL, POLICY),
        claimed=(STATEFUL, POLICY),
    ),
    Mutation(
        name="mps-spares-the-whole-gpu",
        rule="MPS spares only a pod with an MPS client, only on a GPU the admin declared "
        "(core/assess.py _refusal)",
        patches=(
            Patch(
                "gpuguard/core/assess.py",
                "    if charged.mps_clients and mps_declared(device.uuid):\n",
                "    if device.mps:\n",
            ),
        ),
        targets=(STATEFUL, POLICY),
        claimed=(STATEFUL, POLICY),
    ),
    Mutation(
        name="one-listing-confirms",
        rule="two-sample rule: a violation needs two fresh listings (core/policy.py _trigger)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "    if track.samples_over < 2:\n        return None\n",
                "    if track.samples_over < 1:\n        return None\n",
            ),
        ),
        targets=(STATEFUL, POLICY),
        claimed=(STATEFUL, POLICY),
    ),
    Mutation(
        name="pressure-confirms-on-one-listing",
        rule="pressure skips the grace period, never the two fresh listings (core/policy.py "
        "_trigger)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "    if track.samples_over < 2:\n        return None\n"
                "    if step.now - track.first_over_at >= step.policy.grace_seconds:\n"
                "        return Trigger.GRACE\n"
                "    if under_pressure(step.sample, key, step.policy):\n"
                "        return Trigger.PRESSURE\n",
                "    if under_pressure(step.sample, key, step.policy):\n"
                "        return Trigger.PRESSURE\n"
                "    if track.samples_over < 2:\n        return None\n"
                "    if step.now - track.first_over_at >= step.policy.grace_seconds:\n"
                "        return Trigger.GRACE\n",
            ),
        ),
        targets=(STATEFUL, POLICY),
        claimed=(STATEFUL, POLICY),
    ),
    Mutation(
        name="listing-freshness-per-sample",
        rule="a violation counts one more sample only for a listing of its device it has not "
        "counted (core/policy.py _advance, Track.last_seq)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "    fresh = listing.seq != track.last_seq\n",
                "    fresh = step.sample.seq != track.last_seq\n",
            ),
        ),
        targets=(STATEFUL, POLICY),
        claimed=(STATEFUL, POLICY),
    ),
    Mutation(
        name="staleness-per-sample",
        rule="staleness is measured from the oldest listing the sample carries (core/policy.py)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "    if sample is None or now - sample.oldest_listing_at > "
                "policy.staleness_seconds:\n",
                "    if sample is None or now - sample.taken_at > policy.staleness_seconds:\n",
            ),
        ),
        targets=(STATEFUL, POLICY),
        claimed=(STATEFUL, POLICY),
    ),
    Mutation(
        name="exempt-namespace-stopped",
        rule="pods in exempt namespaces (kube-system by default) are never stopped "
        "(core/assess.py assess)",
        patches=(
            Patch(
                "gpuguard/core/assess.py",
                "        exemption = is_exempt(pod.namespace, policy.limits, labelled)\n",
                "        exemption = False\n",
            ),
        ),
        targets=(STATEFUL, POLICY),
        claimed=(STATEFUL, POLICY),
    ),
    Mutation(
        name="sigkill-without-sigterm",
        rule="SIGKILL only to containers this escalation sent SIGTERM (core/policy.py "
        "_escalate, Track.sigterm_sent_to)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "            for t in targets\n"
                "            if t.container_id in track.sigterm_sent_to\n"
                "        )\n",
                "            for t in targets\n        )\n",
            ),
        ),
        targets=(STATEFUL, POLICY),
        claimed=(STATEFUL, POLICY),
    ),
    Mutation(
        name="starttime-check-dropped",
        rule="the killer re-verifies starttime after pidfd_open (adapters/killer.py)",
        patches=(
            Patch(
                "gpuguard/adapters/killer.py",
                "    if now.start_ticks != expected.start_ticks:\n",
                "    if False:\n",
            ),
        ),
        targets=(KERNEL_SIGNALS,),
        claimed=(KERNEL_SIGNALS,),
    ),
    Mutation(
        name="cgroup-check-dropped",
        rule="the killer re-verifies the cgroup after pidfd_open (adapters/killer.py)",
        patches=(
            Patch(
                "gpuguard/adapters/killer.py",
                "    if line_path is None or not is_within(line_path, cgroup.path):\n",
                "    if False:\n",
            ),
        ),
        targets=(KERNEL_SIGNALS,),
        claimed=(KERNEL_SIGNALS,),
    ),
    Mutation(
        name="cgroup-prefix-match",
        rule="a member is within the container component-wise, not by string prefix "
        "(adapters/cgroup_members.py is_within)",
        patches=(
            Patch(
                "gpuguard/adapters/cgroup_members.py",
                '    return path == base or path.startswith(base + "/")\n',
                "    return path.startswith(base)\n",
            ),
        ),
        targets=(KERNEL_SIGNALS,),
        claimed=(KERNEL_SIGNALS,),
    ),
    Mutation(
        name="pod-wide-walk",
        rule="the killer walks the container's cgroup, not its pod's (adapters/killer.py "
        "container_dir)",
        patches=(
            Patch(
                "gpuguard/adapters/killer.py",
                "        return base.joinpath(*rel)\n",
                "        return base.joinpath(*rel[:-1])\n",
            ),
        ),
        targets=(KERNEL_SIGNALS,),
        claimed=(KERNEL_SIGNALS,),
    ),
    Mutation(
        name="dra-acts-on-claims-read-before",
        rule="a violation of a DRA share is acted on only on a read of its claims sent after it "
        "was due (core/policy.py _claims_to_reread)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "    if reads and all(r is not None and r >= asked for r in reads):\n",
                "    if reads:\n",
            ),
        ),
        targets=(POLICY_DRA,),
        claimed=(POLICY_DRA,),
    ),
    Mutation(
        name="dra-default-acts-without-a-read",
        rule="a violation of a default standing in for DRA shares not known yet is acted on only "
        "on a read of the pod's claims sent after it was due (core/policy.py _claims_to_reread, "
        "ResolvedLimit.awaits_dra)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "    if limit.source is not LimitSource.DRA and not limit.awaits_dra:\n",
                "    if limit.source is not LimitSource.DRA:\n",
            ),
        ),
        targets=(POLICY_DRA,),
        claimed=(POLICY_DRA,),
    ),
    Mutation(
        name="dra-group-acts-on-claims-read-before",
        rule="pods over a DRA share they hold together are stopped only on a read of every "
        "member's claims sent after the violation was due (core/policy.py _confirm_group)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "    if not all(m.read_at is not None and m.read_at >= asked for m in "
                "group.members):\n",
                "    if False:\n",
            ),
        ),
        targets=(POLICY_DRA,),
        claimed=(POLICY_DRA,),
    ),
    Mutation(
        name="dra-group-stops-every-sharer",
        rule="of pods over a DRA share they hold together, the largest users are stopped until "
        "what the others use fits, not all of them (core/dra_shares.py largest_first)",
        patches=(
            Patch(
                "gpuguard/core/dra_shares.py",
                "        if remainder <= group.budget_bytes or left[member.pod.uid] <= 0:\n",
                "        if left[member.pod.uid] <= 0:\n",
            ),
        ),
        targets=(POLICY_DRA, STATEFUL),
        claimed=(POLICY_DRA, STATEFUL),
    ),
    Mutation(
        name="container-alone-off",
        rule="a container over its own declared limit is stopped alone while the rest of its "
        "pod fits the pod's limit; its sibling containers are never signalled for it "
        "(core/policy.py _targets, _alone)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "        if alone is not None:\n            return alone\n",
                "        if False:\n            return alone\n",
            ),
        ),
        targets=(POLICY_CONTAINERS,),
        claimed=(POLICY_CONTAINERS,),
    ),
    Mutation(
        name="dra-group-ignores-member-refusals",
        rule="a group over a DRA share is never stopped while a member is exempt or of unknown "
        "usage (core/policy.py _member_refusal)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "    reasons = {m.refusal for m in group.members} - {None, "
                "RefusalReason.NO_CONTAINER}\n",
                "    reasons: set[RefusalReason | None] = set()\n",
            ),
        ),
        targets=(POLICY_DRA, STATEFUL),
        claimed=(POLICY_DRA, STATEFUL),
    ),
    Mutation(
        name="procfs-trusts-a-pin-without-polling-it",
        rule="a pinned process answers for its PID only while its pidfd says it has not exited "
        "(adapters/procfs.py _Pins.answer)",
        patches=(
            Patch(
                "gpuguard/adapters/procfs.py",
                "        self._close_exited()\n",
                "        pass\n",
            ),
        ),
        targets=(PIN_REUSE,),
        claimed=(PIN_REUSE,),
    ),
    Mutation(
        name="killer-waits-on-a-blocked-read",
        rule="the killer waits for a member's /proc reads at most a deadline: one stuck in exec "
        "on a stopped FUSE daemon is refused, the others signalled (adapters/killer.py "
        "_MemberReads)",
        patches=(
            Patch(
                "gpuguard/adapters/killer.py",
                "        ran = self._prober.run(pid, lambda: got.append(read()), wait, "
                "owner=self._owner)\n",
                "        got.append(read())\n        ran = Ran.DONE\n",
            ),
        ),
        targets=(KILLER_STUCK_MEMBER,),
        claimed=(KILLER_STUCK_MEMBER,),
    ),
    Mutation(
        name="gpu-holder-forgotten",
        rule="a process seen with a GPU file open stays a GPU holder for its identity (remembered "
        "and pinned), so closing its files never leaves its memory uncharged "
        "(adapters/procfs.py ProcfsProcessResolver)",
        patches=(
            Patch(
                "gpuguard/adapters/procfs.py",
                "        if scan.holds:\n            self._gpu_known.put(identity, _HOLDER)\n",
                "        if False:\n            pass\n",
            ),
            Patch(
                "gpuguard/adapters/procfs.py",
                "        return not self._check_gpu_fds or result.holds_gpu is True\n",
                "        return not self._check_gpu_fds\n",
            ),
        ),
        targets=(OWNERSHIP_WATCHED,),
        claimed=(OWNERSHIP_WATCHED,),
    ),
    Mutation(
        name="fence-any-node",
        rule="the admission fence lets the agent's token change only the Node its node-name "
        "claim names (manifests/agent-admission-policy.yaml)",
        patches=(
            Patch(
                "manifests/agent-admission-policy.yaml",
                "    - expression: variables.claim == '' || "
                "object.metadata.name == variables.claim\n"
                "      messageExpression: >-\n"
                "        'gpuguard on node '",
                "    - expression: variables.claim == '' || true\n"
                "      messageExpression: >-\n"
                "        'gpuguard on node '",
            ),
        ),
        targets=(FENCE,),
        claimed=(FENCE,),
    ),
    Mutation(
        name="fence-managed-fields-unchecked",
        rule="the admission fence refuses field ownership the API server did not give: another "
        "manager's managedFields entry rewritten by the agent's token "
        "(manifests/agent-admission-policy.yaml)",
        patches=(
            Patch(
                "manifests/agent-admission-policy.yaml",
                "    - expression: size(variables.forgedManagers) == 0\n"
                "      messageExpression: >-\n"
                "        'gpuguard may not rewrite",
                "    - expression: size(variables.forgedManagers) >= 0\n"
                "      messageExpression: >-\n"
                "        'gpuguard may not rewrite",
            ),
        ),
        targets=(FENCE_FORGED,),
        claimed=(FENCE_FORGED,),
    ),
    Mutation(
        name="alloc-guard-resume-unverified",
        rule="the allocation guard resumes only a process still as read when its stop arrived "
        "(starttime, cgroup), re-verified through its pidfd (adapters/killer.py resume)",
        patches=(
            Patch(
                "gpuguard/adapters/killer.py",
                "        changed = _identity_change(expected, now, cgroup_text, cgroup)\n",
                "        changed = None\n",
            ),
        ),
        targets=(GUARD_RESUME_VERIFIED,),
        claimed=(GUARD_RESUME_VERIFIED,),
    ),
    Mutation(
        name="alloc-guard-confirm-without-fresh-listing",
        rule="a frozen allocation confirms its pod over only on a listing of the device taken "
        "after the freeze (core/policy.py _trigger)",
        patches=(
            Patch(
                "gpuguard/core/policy.py",
                "    if frozen_at is not None and step.sample.listing(key).taken_at > frozen_at:\n",
                "    if frozen_at is not None:\n",
            ),
        ),
        targets=(FREEZE,),
        claimed=(FREEZE,),
    ),
    Mutation(
        name="alloc-guard-fate-without-fresh-listing",
        rule="a frozen caller is resumed as not over only on a listing of its device taken after "
        "the freeze (core/freeze.py fate)",
        patches=(
            Patch(
                "gpuguard/core/freeze.py",
                "    if listed_at is None or listed_at <= frozen.frozen_at:\n",
                "    if listed_at is None:\n",
            ),
        ),
        targets=(FREEZE, GUARD_KEPT),
        claimed=(FREEZE, GUARD_KEPT),
    ),
    Mutation(
        name="alloc-guard-forget-not-called",
        rule="the enforcer takes each stop over from the thawer as it takes it in, so the "
        "thawer's bound never resumes it mid-decision (runtime/allocguard.py take_in)",
        patches=(
            Patch(
                "gpuguard/runtime/allocguard.py",
                "                self._guard.forget(tgid=f.tgid)\n",
                "                pass\n",
            ),
        ),
        targets=(GUARD_KEPT,),
        claimed=(GUARD_KEPT,),
    ),
    Mutation(
        name="alloc-guard-no-bound",
        rule="the enforcer resumes a caller it took over when no decision comes within "
        "FREEZE_BOUND_SECONDS (runtime/allocguard.py expire)",
        patches=(
            Patch(
                "gpuguard/runtime/allocguard.py",
                "                if now - f.frozen_at >= FREEZE_BOUND_SECONDS\n",
                "                if False\n",
            ),
        ),
        targets=(GUARD_KEPT,),
        claimed=(GUARD_KEPT,),
    ),
)


NO_SHRINK_PROFILE = """

# Appended by scripts/mutations.py to this temporary copy only: no shrinking.
from hypothesis import Phase as _Phase
from hypothesis import settings as _settings

_settings.register_profile(
    "mutations", phases=[_Phase.explicit, _Phase.reuse, _Phase.generate, _Phase.target]
)
_settings.load_profile("mutations")
"""


class MutationError(Exception):
    """A substitution that did not match exactly once, or a copy that imports the wrong code."""


def make_copy(into: Path, *, shrink: bool, worktree: bool) -> None:
    if worktree:
        for name in COPIED:
            source = REPO / name
            if source.is_dir():
                shutil.copytree(source, into / name, ignore=IGNORED)
            else:
                (into / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, into / name)
    else:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", "HEAD", *COPIED],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    if not shrink:
        with (into / "tests" / "conftest.py").open("a", encoding="utf-8") as conftest:
            conftest.write(NO_SHRINK_PROFILE)


def matches(mutation: Mutation, patch: Patch, text: str) -> None:
    count = text.count(patch.old)
    if count != 1:
        raise MutationError(
            f"{mutation.name}: the text to replace occurs {count} times in {patch.path} "
            f"(must be exactly once):\n{patch.old}"
        )


def apply(mutation: Mutation, root: Path) -> None:
    for patch in mutation.patches:
        path = root / patch.path
        text = path.read_text()
        matches(mutation, patch, text)
        path.write_text(text.replace(patch.old, patch.new))


def environment(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if not env.get("TESTBIN_DIR") and not env.get("KUBEBUILDER_ASSETS"):
        env["TESTBIN_DIR"] = str(REPO / "testbin" / "bin")
    return env


def check_imports_the_copy(root: Path) -> None:
    found = subprocess.run(
        [sys.executable, "-c", "import gpuguard; print(gpuguard.__file__)"],
        cwd=root,
        env=environment(root),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(root.resolve()):
        raise MutationError(f"the copy imports gpuguard from {found}, not from {root}")


FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", re.MULTILINE)
"""A summary line: ``FAILED <test id>`` or ``FAILED <test id> - <message>`` (the ID may hold
spaces: a parametrization's ID)."""
SKIPPED_ONLY = re.compile(r"^\d+ skipped in ", re.MULTILINE)
ERROR_LINE = re.compile(r"^E +(\S.{0,150})", re.MULTILINE)


def failures(stdout: str) -> list[str]:
    """The test IDs pytest's short summary names as failed or erroring, in its order."""
    return [m.group(1).strip() for m in FAILED_LINE.finditer(stdout)]


def verdict_of(returncode: int, stdout: str) -> str:
    """``killed`` (a test failed), ``survived`` (all passed) or ``skipped`` (all skipped)."""
    if returncode == 0:
        return "skipped" if SKIPPED_ONLY.search(stdout) else "survived"
    if returncode == 1:
        return "killed"
    raise MutationError(f"pytest exited {returncode} (not a test failure)")


def judged_by(claim: str, target: str) -> bool:
    """Whether ``target``'s run can catch ``claim``: the claim is the target, or a test (or
    class) inside the target file."""
    return claim == target or claim.startswith(f"{target}::")


def caught(claim: str, failed: list[str]) -> bool:
    """Whether the failures ``failed`` (test IDs) include the claimed test: for a claim naming
    a file, a failure of a test in that file; for one naming a test ID, a failure of that test,
    one of its parametrizations (``ID[...]``), or, for a class, one of its tests."""
    if "::" not in claim:
        return any(f.split("::", 1)[0] == claim for f in failed)
    return any(f == claim or f.startswith((f"{claim}[", f"{claim}::")) for f in failed)


def output_path(out: Path, mutation: Mutation | None, run: int, target: str) -> Path:
    """Where one run's pytest output is kept."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", target).strip("_")
    return out / (mutation.name if mutation else "baseline") / f"run{run}-{slug}.txt"


def run_target(
    root: Path, target: str, seed: int | None, output: Path, *, first_failure_only: bool
) -> Result:
    """Run one target in the copy at ``root``, keep its output at ``output``. With
    ``first_failure_only`` pytest stops at the first failure (``-x``)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", target]
    if first_failure_only:
        command.insert(3, "-x")
    command += [f"--deselect={test}" for test in DESELECTED if test.startswith(f"{target}::")]
    if seed is not None:
        command.append(f"--hypothesis-seed={seed}")
    start = time.monotonic()
    done = subprocess.run(
        command,
        cwd=root,
        env=environment(root),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    seconds = time.monotonic() - start
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        f"$ {' '.join(command)}\n(cwd: the copy; exit status {done.returncode}, {seconds:.1f} s)\n"
        f"\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}",
        encoding="utf-8",
    )
    try:
        verdict = verdict_of(done.returncode, done.stdout)
    except MutationError as e:
        raise MutationError(
            f"{target}: {e}; output: {output}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        ) from None
    return Result(
        target=target,
        verdict=verdict,
        seconds=seconds,
        failed=failures(done.stdout),
        why=next((m.group(1) for m in ERROR_LINE.finditer(done.stdout)), ""),
        output=output,
    )


def first_failure_only(mutation: Mutation | None, target: str) -> bool:
    """``-x`` for a target unless it holds a claimed test of its own (a claim inside it): an
    earlier failure of another test must not stop the run before the claimed one ran."""
    if mutation is None:
        return True
    return not any(c != target and judged_by(c, target) for c in mutation.claimed)


def in_copy(
    mutation: Mutation | None,
    targets: tuple[str, ...],
    seed: int | None,
    *,
    shrink: bool,
    worktree: bool,
    out: Path,
    run: int,
) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="gpuguard-mutation-") as tmp:
        root = Path(tmp)
        make_copy(root, shrink=shrink, worktree=worktree)
        if mutation is not None:
            apply(mutation, root)
        check_imports_the_copy(root)
        return [
            run_target(
                root,
                target,
                seed,
                output_path(out, mutation, run, target),
                first_failure_only=first_failure_only(mutation, target),
            )
            for target in targets
        ]


@dataclass(frozen=True)
class Options:
    """How each copy is made and run."""

    seed: int | None
    shrink: bool
    worktree: bool
    repeat: int
    jobs: int
    claimed_only: bool
    output_dir: Path

    def targets(self, mutation: Mutation) -> tuple[str, ...]:
        return mutation.claimed if self.claimed_only else mutation.targets


def runs(
    pool: concurrent.futures.Executor,
    mutation: Mutation | None,
    targets: tuple[str, ...],
    opts: Options,
) -> list[concurrent.futures.Future[list[Result]]]:
    """``opts.repeat`` fresh copies, each running every target, queued on ``pool``."""
    return [
        pool.submit(
            in_copy,
            mutation,
            targets,
            opts.seed,
            shrink=opts.shrink,
            worktree=opts.worktree,
            out=opts.output_dir,
            run=run,
        )
        for run in range(1, opts.repeat + 1)
    ]


def report(mutation: Mutation, targets: tuple[str, ...], results: list[Result]) -> list[str]:
    """Print one mutation's verdicts; return what the doc claims and the runs contradict: each
    claim judged by the runs of its target must be caught in every one of them."""
    wrong = []
    print(f"{mutation.name}: {mutation.rule}")
    for target in targets:
        found = [r for r in results if r.target == target]
        killed = [r for r in found if r.verdict == "killed"]
        skipped = [r for r in found if r.verdict == "skipped"]
        times = " ".join(f"{r.seconds:.1f}" for r in found)
        verdict = f"killed {len(killed)}/{len(found)}"
        if skipped:
            verdict += f", skipped {len(skipped)}"
        claimed = target in mutation.claimed
        firsts = sorted({r.failed[0] for r in killed if r.failed})
        whys = sorted({r.why for r in killed if r.why})
        print(f"  {target:34} {verdict:12} s: {times}{' (claimed)' if claimed else ''}")
        for name in firsts:
            print(f"      first failure: {name}")
        for why in whys:
            print(f"        {why}")
        for claim in (c for c in mutation.claimed if judged_by(c, target)):
            missed = [r for r in found if not caught(claim, r.failed)]
            said = f"caught {len(found) - len(missed)}/{len(found)}"
            if claim != target:
                print(f"      claimed {claim}: {said}")
            for r in missed:
                print(f"      {claim} not among the failures: {r.output}")
            if missed or not found:
                wrong.append(f"{mutation.name}: {claim} {said}")
    print()
    return wrong


def check(mutations: tuple[Mutation, ...], opts: Options) -> list[str]:
    """Baseline every target, then every mutation: what the runs contradict."""
    targets = tuple(dict.fromkeys(t for m in mutations for t in opts.targets(m)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=opts.jobs) as pool:
        base = runs(pool, None, targets, opts)
        queued = [(m, runs(pool, m, opts.targets(m), opts)) for m in mutations]
        try:
            baseline = [r for f in base for r in f.result()]
            for target in targets:
                found = [r for r in baseline if r.target == target]
                times = " ".join(f"{r.seconds:.1f}" for r in found)
                failed = [r for r in found if r.verdict == "killed"]
                passed = len(found) - len(failed)
                print(f"baseline  {target:34} passed {passed}/{len(found)}  s: {times}")
                if failed:
                    why = f" ({failed[0].why})" if failed[0].why else ""
                    raise MutationError(
                        f"{target} fails without any mutation: {failed[0].failed}{why}; "
                        f"output: {failed[0].output}"
                    )
            print()
            wrong: list[str] = []
            for m, futures in queued:
                wrong += report(m, opts.targets(m), [r for f in futures for r in f.result()])
            return wrong
        except BaseException:
            for _, futures in queued:
                for f in futures:
                    f.cancel()
            raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument(
        "--list",
        action="store_true",
        help="list the mutations, check each substitution matches the working tree once, exit",
    )
    parser.add_argument(
        "--hypothesis-seed",
        type=int,
        default=None,
        help="fix the stateful model's examples (default: fresh ones each run)",
    )
    parser.add_argument(
        "--shrink",
        action="store_true",
        help="let Hypothesis shrink a failure (slow; default: report the first failure)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run each target N times, each in a fresh copy (default 1); a claimed target "
        "must kill its mutation every time",
    )
    parser.add_argument(
        "--claimed-only",
        action="store_true",
        help="run each mutation against the targets that claim it only (what CI runs)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="run up to N copies at once (default 1; the seconds printed then include the "
        "others' load)",
    )
    parser.add_argument(
        "--worktree",
        action="store_true",
        help="copy the working tree's files, uncommitted changes included (default: HEAD)",
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep each run's pytest output under DIR (default: a fresh temporary directory, "
        "printed first and last)",
    )
    return parser


def check_claims(mutation: Mutation) -> None:
    """Every claim is judged by one of the mutation's targets (``judged_by``)."""
    for claim in mutation.claimed:
        if not any(judged_by(claim, t) for t in mutation.targets):
            raise MutationError(f"{mutation.name}: no target runs the claimed {claim}")


def list_mutations(mutations: tuple[Mutation, ...]) -> int:
    """Print each mutation; check each substitution matches the working tree exactly once."""
    for m in mutations:
        print(f"{m.name}: {m.rule}; claimed caught by {', '.join(m.claimed)}")
    try:
        for m in mutations:
            check_claims(m)
            for patch in m.patches:
                matches(m, patch, (REPO / patch.path).read_text())
    except MutationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"every substitution matches exactly once in {REPO}'s working tree")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # progress shows when piped to tee
    mutations = MUTATIONS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTATIONS}
        if unknown:
            parser.error(f"unknown mutation(s): {', '.join(sorted(unknown))}")
        mutations = tuple(m for m in MUTATIONS if m.name in args.only)
    if args.list:
        return list_mutations(mutations)
    output_dir = args.output_dir or Path(tempfile.mkdtemp(prefix="gpuguard-mutations-out-"))
    opts = Options(
        seed=args.hypothesis_seed,
        shrink=args.shrink,
        worktree=args.worktree,
        repeat=args.repeat,
        jobs=args.jobs,
        claimed_only=args.claimed_only,
        output_dir=output_dir.resolve(),
    )
    print_header(opts)
    start = time.monotonic()
    try:
        for m in mutations:
            check_claims(m)
        wrong = check(mutations, opts)
    except MutationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        print(f"pytest output of every run: {opts.output_dir}")
    print(f"wall time: {time.monotonic() - start:.0f} s")
    if wrong:
        print("claimed but not caught:\n  " + "\n  ".join(wrong))
        return 1
    print("every claim caught its mutation in every run")
    return 0


def print_header(opts: Options) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", *COPIED],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    print(f"scripts/mutations.py at {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    if opts.worktree:
        extra = " + uncommitted changes" if dirty else ""
        print(f"source: {REPO}'s working tree at {commit}{extra}")
    else:
        print(f"source: {commit} (git archive HEAD)")
    print(f"python {platform.python_version()}, {platform.node()}, {os.cpu_count()} CPUs")
    seed = opts.seed
    print(f"hypothesis seed: {seed if seed is not None else 'fresh each run'}")
    shrinking = "on" if opts.shrink else "off (a profile appended to the copy's conftest)"
    print(f"hypothesis shrinking: {shrinking}")
    print(
        "each target: python -m pytest -x -q -p no:cacheprovider <target> in a fresh copy"
        " (without -x where a claimed test lies inside it)"
    )
    for test, why in DESELECTED.items():
        print(f"deselected everywhere: {test}: {why}")
    print()
    which = "the targets that claim it" if opts.claimed_only else "every target named for it"
    print(
        f"runs of each target: {opts.repeat}, each in a fresh copy; each mutation against {which}"
    )
    print(f"copies at once: {opts.jobs}")
    print(f"pytest output of every run: {opts.output_dir}")
    print()


if __name__ == "__main__":
    sys.exit(main())
