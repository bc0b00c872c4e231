"""helpers.compiler and notebook 20 on a machine without a C++ compiler.

Inductor on the CPU builds C++ with $CXX, else g++ (clang++ on macOS). ``_find_cxx`` must agree with Inductor: where
it finds a compiler Inductor compiles, and where it finds none Inductor fails, ``aot_eager`` still runs, and the
notebook says which compiler to install and runs top to bottom. The compiler is hidden by running a fresh Python with
CXX unset and a PATH that holds no compiler.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import compiler

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "20-torch-compile.ipynb"
HAS_GXX = shutil.which("g++") is not None


COMPILERS = re.compile(r"(^|-)(g\+\+|c\+\+|clang\+\+|clang|gcc|cc)(-[\d.]+)?$")


def _without_compiler(tmp_path: Path, **extra) -> dict:
    """An environment with no C++ compiler to find: CXX unset, PATH one folder of links to every program on the
    current PATH but the C and C++ compilers (Inductor runs other tools too), a cold Inductor cache."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        for prog in (Path(folder).iterdir() if Path(folder).is_dir() else ()):
            link = bin_dir / prog.name
            if not COMPILERS.search(prog.name) and not link.exists() and os.access(prog, os.X_OK):
                link.symlink_to(prog)
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH=str(bin_dir), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), PYTHONPATH=str(ROOT), **extra)
    return env


def _python(code: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def test_cxx_names_the_compiler_and_a_missing_one_is_none(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert compiler._find_cxx() is None
    assert compiler.pick_backend()[0] == "aot_eager"
    monkeypatch.setenv("CXX", "")  # set but empty: inductor tries "" and finds nothing
    assert compiler._find_cxx() is None
    monkeypatch.delenv("CXX")  # unset: g++ (clang++ on macOS), found where it is on PATH
    found = compiler._find_cxx()
    assert (found is not None) == (shutil.which(compiler._default_cxx()) is not None)


@pytest.mark.skipif(not HAS_GXX, reason="no g++ on this machine")
def test_a_compiler_command_of_two_words_runs(monkeypatch):
    monkeypatch.setenv("CXX", "env g++")  # like "ccache g++": inductor 2.15 splits it the same way
    command, version = compiler._find_cxx()
    assert command == "env g++" and ("g++" in version.lower() or "gcc" in version.lower())
    assert compiler.pick_backend()[0] == "inductor"


def test_without_a_compiler_inductor_fails_and_the_fallback_runs(tmp_path):
    code = (
        "import torch\n"
        "from helpers import compiler\n"
        "backend, why = compiler.pick_backend()\n"
        "print('BACKEND', backend)\n"
        "print('WHY', why)\n"
        "f = lambda x: (x.sin() + 1).sum()\n"
        "x = torch.ones(8)\n"
        "print('AOT_EAGER', torch.compile(f, backend='aot_eager')(x).item() == f(x).item())\n"
        "try:\n"
        "    torch.compile(f)(x)\n"
        "    print('INDUCTOR ran')\n"
        "except Exception as e:\n"
        "    print('INDUCTOR failed', type(e).__name__, e)\n"
    )
    out = _python(code, _without_compiler(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout
    assert "BACKEND aot_eager" in lines and "AOT_EAGER True" in lines, lines
    assert "INDUCTOR failed" in lines and "InvalidCxxCompiler" in lines, lines  # inductor finds none either
    for fix in ("apt install g++", "xcode-select --install", "cxx-compiler", "CXX"):
        assert fix in lines, (fix, lines)


@pytest.mark.skipif(not HAS_GXX, reason="no g++ on this machine")
def test_with_the_compiler_named_in_cxx_inductor_compiles(tmp_path):
    env = _without_compiler(tmp_path, CXX=shutil.which("g++"))  # the same PATH, the compiler named
    out = _python("import torch\nfrom helpers import compiler\nprint(compiler.pick_backend()[0])\n"
                  "f = lambda x: (x.sin() + 1).sum()\nx = torch.ones(8)\n"
                  "print(torch.allclose(torch.compile(f)(x), f(x)))\n", env)
    assert out.returncode == 0 and out.stdout.split() == ["inductor", "True"], out.stdout + out.stderr[-3000:]


@pytest.mark.slow
def test_the_notebook_runs_top_to_bottom_without_a_compiler(tmp_path):
    """Smoke mode, no compiler: the fix is printed, every cell runs with aot_eager, and every check still holds."""
    executed = tmp_path / "19.ipynb"
    code = (
        "import nbformat, nbclient\n"
        f"nb = nbformat.read({str(NOTEBOOK)!r}, as_version=4)\n"
        f"nbclient.NotebookClient(nb, timeout=800, kernel_name='python3', resources={{'metadata': {{'path': "
        f"{str(NOTEBOOK.parent)!r}}}}}).execute()\n"
        f"nbformat.write(nb, {str(executed)!r})\n"
    )
    out = _python(code, _without_compiler(tmp_path, SMOKE_TEST="1"), timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    outputs = [o for c in json.loads(executed.read_text())["cells"] if c["cell_type"] == "code"
               for o in c.get("outputs", [])]
    text = "".join("".join(o.get("text", "")) for o in outputs)  # a stream's text: a string or a list of lines
    assert "apt install g++" in text and "aot_eager" in text, text[:2000]
    assert "max |compiled − eager| (aot_eager)" in text, text[-2000:]


# ---- on a GPU: Triton, a C compiler and Python.h (triton/runtime/build.py), each named when missing ----

def _gpu_ready(monkeypatch, tmp_path, triton=True, cc="/usr/bin/gcc", python_h=True):
    include = tmp_path / "include"
    include.mkdir(exist_ok=True)
    if python_h:
        (include / "Python.h").write_text("/* headers */")
    monkeypatch.setattr(compiler, "_has_triton", lambda: triton)
    monkeypatch.setattr(compiler, "_find_cc", lambda: cc)
    monkeypatch.setattr(compiler, "_python_include", lambda: include)


def test_a_gpu_with_triton_a_c_compiler_and_python_h_compiles_with_inductor(monkeypatch, tmp_path):
    _gpu_ready(monkeypatch, tmp_path)
    backend, why = compiler.pick_backend("cuda")
    assert backend == "inductor" and "/usr/bin/gcc" in why


@pytest.mark.parametrize("missing, fix", [
    (dict(triton=False), "pip install triton"),
    (dict(cc=None), "sudo apt install gcc"),
    (dict(python_h=False), "-dev`"),  # python3.X-dev, or python3-dev for the system's Python
])
def test_a_gpu_missing_a_piece_falls_back_and_names_the_package(monkeypatch, tmp_path, missing, fix):
    _gpu_ready(monkeypatch, tmp_path, **missing)
    backend, why = compiler.pick_backend("cuda")
    assert backend == "aot_eager" and fix in why and "aot_eager" in why, why
    if "python_h" in missing:
        assert "python3-dev" in why and str(tmp_path / "include") in why


def test_the_gpu_checks_look_where_triton_looks(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "/opt/cc")  # $CC is taken as given
    assert compiler._find_cc() == "/opt/cc"
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    assert compiler._find_cc() is None
    import sysconfig

    assert compiler._python_include() in {Path(sysconfig.get_paths(scheme=s)["include"])
                                          for s in sysconfig.get_scheme_names()}
    with pytest.raises(ValueError, match="mps"):
        compiler.pick_backend("mps")


def test_fsdp2_hooks_are_kept_out_of_graphs_by_version():
    """Notebook 20 says: torch 2.11 skips FSDP2's hooks while torch._dynamo.config.skip_fsdp_hooks is on (the
    default); torch 2.15 has no such option and wraps every hook in torch._dynamo.disable (issue 43, item 18)."""
    import inspect

    import torch
    import torch._dynamo.config
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    if torch.__version__ >= (2, 15):
        assert not hasattr(torch._dynamo.config, "skip_fsdp_hooks")
        assert "torch._dynamo.disable" in inspect.getsource(_fsdp_common._dynamo_disable)
    else:
        assert getattr(torch._dynamo.config, "skip_fsdp_hooks", True) is True  # on by default (2.11)
