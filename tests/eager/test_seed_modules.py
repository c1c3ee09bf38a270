"""Every module path of the seed library that holds public names (recorded from the installed
package in data/seed_modules.tsv) exists here with the import changed, holding its names: a name
whose object this project has (at the seed's documented home of the same object) is that object
at the path too; any other is refused with an `ImportError` naming what to use. The names of the
modules docs/migrating.md tables name by name are that page's business (test_migrating_table)."""

import importlib

import pytest
import seed_modules

RECORDED = seed_modules.recorded()
MODULES = sorted({m for m, _, _ in RECORDED})


def ours(module: str) -> str:
    return module.replace("spectrax", "spectrax_eager", 1)


def problems(rows) -> list[str]:
    """What is wrong with the paths here for `rows` `(module, name, home)` (empty: nothing)."""
    found = []
    for module, name, home in rows:
        try:
            here = importlib.import_module(ours(module))
        except ImportError as e:
            found.append(f"{module}: {e}")
            continue
        if module in seed_modules.HOMES:
            continue
        expected = getattr(importlib.import_module(ours(home)), name, None) if home != "-" else None
        try:
            obj = getattr(here, name)
        except ImportError as e:
            if expected is not None:
                found.append(f"{module}.{name}: refused, but {ours(home)}.{name} is here")
            elif not (
                str(e).startswith(f"cannot import name {name!r} from {ours(module)!r}: ") and len(str(e)) > 80
            ):
                found.append(f"{module}.{name}: refused without saying what to use: {e}")
            continue
        except AttributeError:
            found.append(f"{module}.{name}: neither here nor refused")
            continue
        if expected is not None and obj is not expected:
            found.append(f"{module}.{name}: {obj!r} is not {ours(home)}.{name}")
    return found


def test_the_record_covers_the_seed_library_s_public_modules():
    assert len(MODULES) >= 120 and len(RECORDED) >= 850
    assert {
        "spectrax.runtime.schedules",
        "spectrax.runtime.types.array",
        "spectrax.runtime.mpmd.markers",
    } <= set(MODULES)


@pytest.mark.parametrize("package", sorted({".".join(m.split(".")[:2]) for m in MODULES}))
def test_every_seed_module_path_holds_its_names_here(package):
    rows = [r for r in RECORDED if r[0] == package or r[0].startswith(package + ".")]
    assert problems(rows) == []


def test_the_names_of_the_issue_s_programs_import():
    import spectrax_eager as spx
    from spectrax_eager.runtime.mpmd.markers import stage_region_specs, sxstage_iter
    from spectrax_eager.runtime.schedules import DualPipeV, FusedTask, dualpipev_tasks
    from spectrax_eager.runtime.types.array import abstract_stages_array

    assert DualPipeV is spx.DualPipeV and FusedTask is spx.runtime.FusedTask
    assert (
        dualpipev_tasks is spx.runtime.dualpipev_tasks
        and stage_region_specs is spx.runtime.stage_region_specs
    )
    assert abstract_stages_array is spx.runtime.abstract_stages_array and sxstage_iter is spx.sxstage_iter


def test_a_submodule_named_like_a_function_leaves_the_function_in_place():
    import spectrax_eager as spx
    import spectrax_eager.functional.linear
    import spectrax_eager.inspect.summary

    assert callable(spx.functional.linear) and callable(spx.inspect.summary)
    assert spectrax_eager.functional.linear.__name__ == "linear"


def test_the_checker_can_fail(monkeypatch):
    import spectrax_eager.core.graph

    def curt_refusal(name):
        raise ImportError(name)

    assert problems([("spectrax.nowhere", "x", "-")])  # a missing module
    assert problems([("spectrax.core.graph", "Module", "spectrax")])  # refused, though spx has it
    assert problems([("spectrax.core.graph", "bogus", "-")]) == []  # refused, saying what to use
    monkeypatch.setattr(spectrax_eager.core.graph, "export", object())
    assert problems([("spectrax.core.graph", "export", "spectrax")])  # not the home's object
    monkeypatch.setattr(spectrax_eager.core.graph, "__getattr__", curt_refusal)
    assert problems([("spectrax.core.graph", "bogus", "-")])  # refused without saying what to use
