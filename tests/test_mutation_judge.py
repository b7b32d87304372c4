"""How ``scripts/mutations.py`` judges a run: a claim is caught only when pytest's summary names
the claimed test (or, for a claimed file, a test of that file) among the failures. A failure of
another test of the same file is a kill of the target, never a catch of a claimed test ID.
Synthetic pytest outputs, plus one real pytest run over a two-test file."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.scripts_loader import load_script

mutations = load_script("mutations")

FILE = "tests/test_policy.py"
CLAIMED = f"{FILE}::test_a_tainted_pid_is_never_charged"
OTHER = f"{FILE}::test_a_ghost_settles"

SUMMARY = f"""\
..F.F                                                                    [100%]
=================================== FAILURES ===================================
E   assert 1 == 2
=========================== short test summary info ============================
FAILED {OTHER} - assert 1 == 2
FAILED {CLAIMED}[every call fails] - AssertionError: FAILED {FILE}::decoy
ERROR tests/test_stateful.py::TestModel::runTest
FAILED {FILE}::test_fence[a - b]
2 failed, 3 passed in 0.52s
"""


def test_failures_are_the_summarys_test_ids_with_their_messages_cut_off() -> None:
    assert mutations.failures(SUMMARY) == [
        OTHER,
        f"{CLAIMED}[every call fails]",
        "tests/test_stateful.py::TestModel::runTest",
        f"{FILE}::test_fence[a",  # an ID holding " - " is cut there: no such ID is claimed
    ]


def test_a_failure_of_another_test_of_the_file_does_not_catch_a_claimed_test_id() -> None:
    assert not mutations.caught(CLAIMED, [OTHER])
    assert not mutations.caught(CLAIMED, [f"{CLAIMED}_too"])  # a longer name, not the test
    assert not mutations.caught(CLAIMED, [])


def test_a_claimed_test_id_is_caught_by_its_own_failure_or_a_parametrization_of_it() -> None:
    assert mutations.caught(CLAIMED, [OTHER, CLAIMED])
    assert mutations.caught(CLAIMED, [f"{CLAIMED}[native-every call fails]"])
    assert mutations.caught(f"{FILE}::TestModel", [f"{FILE}::TestModel::runTest"])


def test_a_claimed_file_is_caught_by_a_failure_of_any_test_in_it_and_only_in_it() -> None:
    assert mutations.caught(FILE, [OTHER])
    assert not mutations.caught(FILE, ["tests/test_policy_dra.py::test_x"])
    assert not mutations.caught(FILE, [])


@pytest.mark.parametrize(
    ("returncode", "stdout", "verdict"),
    [
        (0, "3 passed in 0.10s\n", "survived"),
        (0, "3 skipped in 0.10s\n", "skipped"),
        (0, "1 passed, 2 skipped in 0.10s\n", "survived"),
        (1, SUMMARY, "killed"),
    ],
)
def test_the_exit_status_gives_the_targets_verdict(
    returncode: int, stdout: str, verdict: str
) -> None:
    assert mutations.verdict_of(returncode, stdout) == verdict


def test_an_exit_status_other_than_a_test_failure_stops_the_script() -> None:
    with pytest.raises(mutations.MutationError, match="exited 2"):
        mutations.verdict_of(2, "Interrupted: 1 error during collection\n")


def _mutation(*claimed: str) -> object:
    return mutations.Mutation(
        name="m", rule="r", patches=(), targets=(FILE,), claimed=tuple(claimed)
    )


def _killed(*failed: str) -> object:
    return mutations.Result(
        target=FILE, verdict="killed", seconds=1.0, failed=list(failed), output=Path("/o/run1")
    )


def test_a_kill_by_another_test_leaves_the_claim_contradicted_and_names_the_output(
    capsys: pytest.CaptureFixture[str],
) -> None:
    wrong = mutations.report(_mutation(CLAIMED), (FILE,), [_killed(OTHER), _killed(CLAIMED)])
    assert wrong == [f"m: {CLAIMED} caught 1/2"]
    assert f"{CLAIMED} not among the failures: /o/run1" in capsys.readouterr().out


def test_a_claim_caught_in_every_run_is_not_contradicted() -> None:
    assert mutations.report(_mutation(CLAIMED, FILE), (FILE,), [_killed(OTHER, CLAIMED)]) == []
    assert mutations.report(_mutation(FILE), (FILE,), [_killed(OTHER), _killed(CLAIMED)]) == []


def test_a_survived_or_skipped_run_catches_nothing() -> None:
    survived = mutations.Result(target=FILE, verdict="survived", seconds=1.0)
    skipped = mutations.Result(target=FILE, verdict="skipped", seconds=1.0)
    assert mutations.report(_mutation(FILE), (FILE,), [survived, skipped]) == [
        f"m: {FILE} caught 0/2"
    ]


def test_a_target_holding_a_claimed_test_runs_past_its_first_failure() -> None:
    assert not mutations.first_failure_only(_mutation(CLAIMED), FILE)
    assert mutations.first_failure_only(_mutation(FILE), FILE)
    assert mutations.first_failure_only(None, FILE)


def test_a_claim_no_target_runs_is_refused() -> None:
    mutations.check_claims(_mutation(FILE, CLAIMED))
    with pytest.raises(mutations.MutationError, match="no target runs"):
        mutations.check_claims(_mutation("tests/test_policy_dra.py"))


def test_a_real_run_keeps_its_output_and_names_only_the_failing_test(tmp_path: Path) -> None:
    (tmp_path / "cases.py").write_text(
        textwrap.dedent(
            """
            def test_fails():
                assert "the mutation" == "noticed"

            def test_passes():
                pass
            """
        )
    )
    output = tmp_path / "out" / "m" / "run1-cases.py.txt"
    result = mutations.run_target(tmp_path, "cases.py", None, output, first_failure_only=False)
    assert (result.verdict, result.failed) == ("killed", ["cases.py::test_fails"])
    assert result.output == output
    kept = output.read_text()
    assert "exit status 1" in kept
    assert "FAILED cases.py::test_fails" in kept
    assert mutations.caught("cases.py", result.failed)
    assert not mutations.caught("cases.py::test_passes", result.failed)
