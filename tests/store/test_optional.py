"""guarduq works without the store extra; the store says which extra it needs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK = textwrap.dedent(
    """
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("sqlalchemy", "alembic", "psycopg"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name.split(".")[0])
    sys.meta_path.insert(0, Block())
    """
)


def test_guarduq_imports_without_sqlalchemy() -> None:
    code = BLOCK + textwrap.dedent(
        """
        import guarduq, guarduq.store
        from guarduq.store import ReviewSampler, fit_weights
        assert ReviewSampler(rate=0.5, seed=0).draw(0.5, False).rate == 0.5
        assert "sqlalchemy" not in sys.modules
        try:
            from guarduq.store import Store
        except guarduq.GuardUQError as exc:
            print(exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "the store needs the 'store' extra (missing module 'sqlalchemy'): pip install 'guarduq[store]'" in out.stdout
