"""Signature compatibility against the seed library's recorded interface (tests/eager/data).

`seed_interface.tsv` lists each public name of the seed library's modules as
`module<TAB>name<TAB>kind<TAB>signature`, the signature reduced to parameter
names and kinds (`name=...` has a default). It was written from inspecting the
installed package, so these tests never need it installed.
"""

from __future__ import annotations

import importlib
import inspect
import math
from pathlib import Path

DATA = Path(__file__).parent / "data" / "seed_interface.tsv"

#: Where each seed module's names live here.
OURS = {
    "spectrax": "spectrax_eager",
    "spectrax.nn": "spectrax_eager.nn",
    "spectrax.sharding": "spectrax_eager.sharding",
    "spectrax.init": "spectrax_eager.init",
    "spectrax.functional": "spectrax_eager.functional",
    "spectrax.inspect": "spectrax_eager.inspect",
    "spectrax.hooks": "spectrax_eager.hooks",
    "spectrax.runtime": "spectrax_eager.runtime",
}


def seed_interface() -> list[tuple[str, str, str, inspect.Signature | None]]:
    """`(module, name, kind, signature or None)` for every recorded seed name."""
    out = []
    for line in DATA.read_text().splitlines():
        module, name, kind, sig = line.split("\t")
        out.append((module, name, kind, None if sig == "-" else _parse(sig)))
    return out


def _parse(sig: str) -> inspect.Signature:
    scope: dict = {}
    exec(f"def f{sig}: pass", scope)  # parameter names and kinds only: no annotations, defaults are `...`
    return inspect.signature(scope["f"])


def ours(module: str, name: str):
    """Our object for a seed name, or None when absent."""
    return getattr(importlib.import_module(OURS[module]), name, None)


def our_signature(obj) -> inspect.Signature | None:
    try:
        sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if inspect.isclass(obj) and params and params[0].name == "self":
        params = params[1:]
    return sig.replace(parameters=params)


_POS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_KW = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def incompatibilities(seed: inspect.Signature, mine: inspect.Signature) -> list[str]:
    """Why a call written for `seed` could fail against `mine` (empty: compatible).

    Every seed positional parameter needs a positional one at its index here (or
    `*args`); every seed keyword needs the same keyword here (or `**kwargs`);
    `*args` / `**kwargs` need theirs; and nothing required here may be optional
    (or missing) there. Parameters whose names start with `_` are private and skipped.
    """
    sp, mp = list(seed.parameters.values()), list(mine.parameters.values())
    m_pos = [p for p in mp if p.kind in _POS]
    m_kw = {p.name for p in mp if p.kind in _KW}
    m_var = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in mp)
    m_varkw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in mp)
    problems = []
    s_pos = [p for p in sp if p.kind in _POS]
    if len(s_pos) > len(m_pos) and not m_var:
        problems.append(f"takes {len(m_pos)} positional arguments, the seed {len(s_pos)}")
    sp = [p for p in sp if not p.name.startswith("_")]  # private parameters are no interface
    for p in sp:
        if p.kind in _KW and p.name not in m_kw and not m_varkw:
            if p.kind is inspect.Parameter.KEYWORD_ONLY or p.default is not inspect.Parameter.empty:
                problems.append(f"no keyword {p.name!r}")
        if p.kind is inspect.Parameter.VAR_POSITIONAL and not m_var:
            problems.append(f"no *{p.name}")
        if p.kind is inspect.Parameter.VAR_KEYWORD and not m_varkw:
            problems.append(f"no **{p.name}")
    s_required_pos = sum(p.kind in _POS and p.default is inspect.Parameter.empty for p in sp)
    s_required_kw = {p.name for p in sp if p.kind in _KW and p.default is inspect.Parameter.empty}
    for i, p in enumerate(m_pos):
        if p.default is inspect.Parameter.empty and i >= s_required_pos and p.name not in s_required_kw:
            problems.append(f"requires {p.name!r}, optional or absent in the seed")
    for p in mp:
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty:
            if p.name not in s_required_kw:
                problems.append(f"requires keyword {p.name!r}")
    return problems


def status(module: str, name: str, kind: str, seed_sig: inspect.Signature | None) -> tuple[str, list[str]]:
    """`("absent" | "differs" | "same", problems)` of one seed name here."""
    obj = ours(module, name)
    if obj is None:
        return "absent", []
    if seed_sig is None or kind in ("module", "value"):
        return "same", []
    mine = our_signature(obj)
    if mine is None:
        return "differs", ["signature unreadable"]
    problems = incompatibilities(seed_sig, mine)
    return ("differs" if problems else "same"), problems


def differences(got, want, where="") -> list[str]:
    """Where `got` differs from `want`: floats within rtol 1e-4 / atol 1e-5, the rest exactly."""
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [f"{where}: keys {sorted(got)} != {sorted(want)}"]
        return [d for k in want for d in differences(got[k], want[k], f"{where}.{k}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{where}: length {len(got)} != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{where}[{i}]")]
    if isinstance(want, float) and isinstance(got, int | float) and not isinstance(got, bool):
        ok = math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-5) or (math.isnan(got) and math.isnan(want))
        return [] if ok else [f"{where}: {got} != {want}"]
    return [] if (type(got) is type(want) and got == want) else [f"{where}: {got!r} != {want!r}"]
