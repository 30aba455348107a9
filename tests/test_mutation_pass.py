"""The mutation pass's bookkeeping: which mutants a target owns, and the table it reports."""

from __future__ import annotations

from pathlib import Path

from scripts.mutation_pass import TARGETS, Target, check_functions, mutated_code, report

GATE = Target("evaluation/gate.py", None, ())
VERIFY = Target("environments/tasks/web_tasks.py", ("verify",), ())


def test_a_target_owns_its_functions_mutants_only() -> None:
    assert VERIFY.patterns() == ["flywheel.environments.tasks.web_tasks.x_verify__mutmut_*"]
    assert VERIFY.owns("flywheel.environments.tasks.web_tasks.x_verify__mutmut_3")
    assert not VERIFY.owns("flywheel.environments.tasks.web_tasks.x_verify_more__mutmut_3")
    assert not VERIFY.owns("flywheel.environments.tasks.web_tasks.x_make_task__mutmut_1")
    method = Target("environments/swe_bench.py", ("SWEBenchEnv.verify",), ())
    assert method.owns("flywheel.environments.swe_bench.xǁSWEBenchEnvǁverify__mutmut_1")
    assert GATE.owns("flywheel.evaluation.gate.x_decide__mutmut_1") and not GATE.owns("flywheel.evaluation.gates.x")


def test_every_listed_function_exists() -> None:
    assert check_functions(list(TARGETS)) == []
    assert check_functions([Target("evaluation/gate.py", ("no_such_function",), ())]) == [
        "evaluation/gate.py: no_such_function"
    ]


def test_the_table_counts_a_sample_and_a_timeout_as_caught() -> None:
    gate = "flywheel.evaluation.gate.x_decide__mutmut_"
    verify = "flywheel.environments.tasks.web_tasks.x_verify__mutmut_"
    found = {f"{gate}1": "killed", f"{gate}2": "survived", f"{gate}3": "not checked", f"{gate}4": "timeout"}
    found |= {f"{verify}1": "killed", f"{verify}2": "no tests"}
    table, survivors = report([GATE, VERIFY], found)
    assert table.splitlines()[2:] == [
        "| evaluation/gate.py | 3 of 4 | 1 | 1 | 1 | 0 | 0 | 66.7 |",
        "| environments/tasks/web_tasks.py | 2 | 1 | 0 | 0 | 1 | 0 | 50.0 |",
        "| **all** | 5 of 6 | 2 | 1 | 1 | 1 | 0 | 60.0 |",
    ]
    assert survivors == [f"{gate}2", f"{verify}2"]


MODULE = """def a():
    return 1


class C:
    def b(self):
        return 2


def c():
    return 3
"""


def test_the_code_a_target_mutates_is_its_functions_only(tmp_path: Path) -> None:
    """`--again` refuses a pass whose mutated code changed since, and only that code."""
    module = tmp_path / "m.py"
    module.write_text(MODULE)
    target = Target("m.py", ("a", "C.b"), ())
    before = mutated_code(tmp_path, target)
    assert "return 1" in before and "return 2" in before and "return 3" not in before
    module.write_text(module.read_text().replace("return 3", "return 4"))
    assert mutated_code(tmp_path, target) == before
    module.write_text(module.read_text().replace("return 2", "return 5"))
    assert mutated_code(tmp_path, target) != before
    assert mutated_code(tmp_path, Target("m.py", None, ())) == module.read_text()
