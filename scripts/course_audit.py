"""Read the notebooks as a learner would and count what the course promises (tests/test_course.py runs it).

Per notebook: reading words (markdown plus the English inside code strings) and the share in code strings,
concept figures, links to sources, exercises and solution cells; the functions it launches that no notebook
defines; and, for the course, each lesson whose torch calls appear in no notebook cell (strings and comments
do not count: the calls must be code a learner can read and change).

    python scripts/course_audit.py          # a table, the GPU routes per machine class, then what is missing
    python scripts/course_audit.py --readme # rewrite README.md's notebook table from the notebooks' headers
"""

from __future__ import annotations

import ast
import functools
import io
import json
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # helpers, for the GPU routes (make audit runs it with the system python)

# lesson → (notebook name pattern, torch calls that must be code in one of its cells)
LESSONS = {
    "the training loop": (r"01-", ["backward", "zero_grad", "step"]),
    "DataParallel's four steps": (r"02-", ["replicate", "scatter", "parallel_apply", "gather"]),
    "the DDP step": (r"04-ddp", ["DistributedDataParallel", "DistributedSampler", "init_process_group"]),
    "set_epoch": (r"ddp-habits", ["set_epoch"]),
    "rank-0 save and map_location resume": (r"ddp-habits", ["torch.save", "map_location"]),
    "no_sync accumulation": (r"ddp-habits", ["no_sync"]),
    "SyncBatchNorm": (r"ddp-habits", ["convert_sync_batchnorm"]),
    "autocast and GradScaler": (r"large-batch", ["autocast", "GradScaler", "scale"]),
    "LR scaling and warm-up": (r"large-batch", ["LinearLR"]),
    "the model cut across devices": (r"model-parallel", ["deepcopy", "Identity", "to"]),
    "PipelineStage and a schedule": (r"pipelin", ["PipelineStage", "ScheduleGPipe", "Schedule1F1B"]),
    "DataLoader workers": (r"data-loading", ["DataLoader", "num_workers", "pin_memory", "persistent_workers"]),
    "CUDA_VISIBLE_DEVICES masks": (r"visible-devices", ["CUDA_VISIBLE_DEVICES"]),
    "the torchrun script's loop": (r"torchrun", ["init_process_group", "set_epoch", "LOCAL_RANK"]),
    "the collectives, and a ring all-reduce by hand": (r"collectives", ["all_reduce", "all_gather", "send", "recv"]),
    "saved activations and checkpointing": (r"memory", ["saved_tensors_hooks", "checkpoint", "to_empty"]),
    "fully_shard": (r"fsdp", ["fully_shard", "MixedPrecisionPolicy"]),
    "distributed checkpoints": (r"distributed-checkpoints", ["dcp.save", "dcp.load"]),
    "tensor parallelism on a mesh": (r"tensor-parallel", ["init_device_mesh", "parallelize_module", "ColwiseParallel",
                                                          "RowwiseParallel"]),
    "the Keras model under DDP": (r"keras", ["keras.layers", "DistributedDataParallel", "DistributedSampler"]),
    "FSDP2 as production uses it": (r"fsdp", ["set_requires_gradient_sync", "clip_grad_norm_",
                                              "set_modules_to_forward_prefetch", "init_device_mesh"]),
    "tensor parallelism on the GPT": (r"tensor-parallel", ["SequenceParallel", "PrepareModuleInput", "loss_parallel"]),
    "ring attention by hand": (r"context-parallel", ["batch_isend_irecv", "logaddexp", "context_parallel"]),
    "experts dispatched with all-to-all": (r"expert-parallel", ["all_to_all_single", "topk", "init_device_mesh"]),
}

WORD = re.compile(r"[A-Za-z][A-Za-z'’-]*")
LAUNCHERS = {"launch", "run_rank"}  # calls whose first argument is a function forked ranks run


@dataclass
class Report:
    name: str
    words: int = 0
    string_words: int = 0
    figures: int = 0
    links: int = 0
    exercises: int = 0
    solutions: int = 0
    code: str = ""  # code cells joined, strings and comments removed
    code_lines: int = 0  # lines of code (no blank or comment-only lines), solution cells left out
    helper_calls: int = 0  # calls into the course's machinery in helpers, solution cells left out
    page_calls: int = 0  # calls of code a notebook wrote on its page and exported (the ConvNet, the GPT, ...)
    torch_calls: int = 0  # calls into torch (torchvision, keras), solution cells left out
    longest_function: tuple[int, str] = (0, "")  # (lines of code, name) of the longest def on the page, solutions out
    gpu_lines: list[str] = field(default_factory=list)  # code only a GPU runs: the bodies of GPU-only branches
    process_risks: list[str] = field(default_factory=list)  # top-level CUDA or autograd in the notebook process
    defined: set[str] = field(default_factory=set)
    launched: set[str] = field(default_factory=set)

    @property
    def string_share(self) -> float:
        return self.string_words / self.words if self.words else 0.0


def _python(src: str) -> str:
    """A cell's source with IPython magics and shell lines commented out, so ast and tokenize can read it."""
    return "\n".join("#" + line if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines())


def _code_and_strings(src: str) -> tuple[str, list[str]]:
    """(the cell's code with strings and comments blanked out, the English string literals) of one cell."""
    lines = _python(src).splitlines(keepends=True)
    spans, strings = [], []
    string_kinds = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)}
    try:
        for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
            if tok.type in string_kinds:
                strings.append(tok.string)
                spans.append((tok.start, tok.end))
            elif tok.type == tokenize.COMMENT:
                spans.append((tok.start, tok.end))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return src, []
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    text = list("".join(lines))
    for (r0, c0), (r1, c1) in spans:
        for i in range(offsets[r0 - 1] + c0, offsets[r1 - 1] + c1):
            if text[i] != "\n":
                text[i] = " "
    # English only: the code inside an f-string's braces is not reading
    prose = [re.sub(r"\{[^{}]*\}", " ", s) for s in strings]
    english = [s for s in prose if " " in s and len(WORD.findall(s)) >= 3]
    return "".join(text), english


def _function(node: ast.expr, aliases: dict[str, ast.expr]) -> str | None:
    """The function a launch runs: ``partial(f, ...)`` and names bound to one are opened; a lambda is on the page."""
    for _ in range(10):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("functools.partial", "partial") and node.args:
            node = node.args[0]
        elif isinstance(node, ast.Name) and node.id in aliases:
            node = aliases.pop(node.id)
        else:
            break
    return None if isinstance(node, ast.Lambda) else ast.unparse(node)


def _calls(src: str, aliases: dict[str, ast.expr]) -> tuple[set[str], set[str]]:
    """(functions defined, functions launched) in one cell; ``aliases`` gathers ``name = partial(...)`` bindings."""
    try:
        tree = ast.parse(_python(src))
    except SyntaxError:
        return set(), set()
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            aliases[n.targets[0].id] = n.value
    launched = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and n.args:
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in LAUNCHERS:
                fn = _function(n.args[0], dict(aliases))
                if fn is not None:
                    launched.add(fn)
    return defined, launched


LIBRARIES = {"torch": "torch", "torchvision": "torch", "keras": "torch", "helpers": "helpers"}


def _origins(tree: ast.AST, origins: dict[str, str]) -> None:
    """Names a cell imports, mapped to 'torch' or 'helpers' (the library they come from)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                lib = LIBRARIES.get(a.name.split(".")[0])
                if lib:
                    origins[(a.asname or a.name).split(".")[0]] = lib
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            lib = LIBRARIES.get(n.module.split(".")[0])
            if lib:
                for a in n.names:
                    origins[a.asname or a.name] = lib


@functools.cache
def written_on_a_page(root: Path = ROOT) -> frozenset[str]:
    """Names a notebook defines in an exported cell (``#| export helpers/...``): the course's lessons, kept in helpers
    so that later pages reuse them (d2l's ``#@save``): the ConvNet, train_one_epoch, the GPT, ring_all_reduce, ..."""
    names = set()
    for path in (root / "notebooks").glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            src = "".join(cell["source"])
            if cell["cell_type"] == "code" and re.match(r"#\|\s*export\s", src):
                try:
                    tree = ast.parse(_python(src))
                except SyntaxError:
                    continue
                names |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return frozenset(names)


def _library_calls(tree: ast.AST, origins: dict[str, str]) -> dict[str, int]:
    """How many calls in a cell go to torch, to the course's machinery in helpers, and to code an earlier page wrote
    (exported into helpers), by the name each call starts from."""
    counts = {"torch": 0, "helpers": 0, "pages": 0}
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            root = n.func
            while isinstance(root, ast.Attribute):  # torch.nn.Linear(...) yes; F.relu(x).sum() counts once
                root = root.value
            if isinstance(root, ast.Name) and root.id in origins:
                called = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                page = origins[root.id] == "helpers" and called in written_on_a_page()
                counts["pages" if page else origins[root.id]] += 1
    return counts


# Code that starts CUDA or runs autograd in the notebook's own process breaks every later GPU fork (launch refuses
# once CUDA started; a CPU backward poisons a forked rank's CUDA): only inside functions, which ranks or children run.
SAFE_CUDA = {"is_available", "device_count", "is_initialized", "is_bf16_supported", "get_device_name"}
GPU_TEST = re.compile(r"n_gpus|gpu_count\(|\.type\s*==\s*[\"']cuda|cuda\.is_available|has_gpu|GPUS\b", re.I)


def _top_level(tree: ast.Module):
    """Every node a cell runs in the notebook process itself: not inside a function, lambda or class."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def process_risk(node: ast.AST) -> str | None:
    """Why a top-level call would start CUDA or autograd in the notebook process, or None."""
    if not isinstance(node, ast.Call):
        return None
    name = ast.unparse(node.func)
    if name.endswith(".backward") or name in ("torch.autograd.grad", "autograd.grad"):
        return "autograd"
    cuda = (name.endswith(".cuda")
            or any(kw.arg == "device" and isinstance(kw.value, ast.Constant) and str(kw.value.value).startswith("cuda")
                   for kw in node.keywords)
            or (name.endswith(".to") and node.args and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("cuda")))
    if cuda:
        return "CUDA"
    m = re.match(r"torch\.cuda\.(\w+)$", name)
    if m and m.group(1) not in SAFE_CUDA:
        return f"torch.cuda.{m.group(1)}"
    return None


def _gpu_only(tree: ast.AST) -> list[str]:
    """The lines inside ``if <a GPU test>:`` branches: code CI, which has no GPU, never runs."""
    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and GPU_TEST.search(test := ast.unparse(n.test)):
            negated = re.search(r"\bnot\b|<|==\s*0\b", test)  # `if not n_gpus:` is the CPU's branch
            lines += [line for b in (n.orelse if negated else n.body) for line in ast.unparse(b).splitlines()]
    return lines


def _written_script(src: str) -> ast.Module | None:
    """The Python a ``%%writefile <file>.py`` cell writes (a script torchrun or a child runs), else None."""
    first, _, body = src.lstrip().partition("\n")
    if not re.match(r"%%writefile\s+\S+\.py\s*$", first):
        return None
    try:
        return ast.parse(body)
    except SyntaxError:
        return None


def _function_lengths(tree: ast.AST, src: str) -> list[tuple[int, str]]:
    """(lines of code, name) of every function a cell defines (nested ones too): its non-blank, non-comment lines."""
    lines = src.splitlines()
    found = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = lines[n.lineno - 1:n.end_lineno]
            doc = n.body[0] if n.body and isinstance(n.body[0], ast.Expr) and isinstance(
                getattr(n.body[0], "value", None), ast.Constant) and isinstance(n.body[0].value.value, str) else None
            skip = set(range(doc.lineno, doc.end_lineno + 1)) if doc else set()
            count = sum(1 for i, line in enumerate(body, n.lineno)
                        if i not in skip and line.strip() and not line.strip().startswith("#"))
            found.append((count, n.name))
    return found


def _exercises(markdown: str) -> int:
    m = re.search(r"^#+\s*Exercises\s*$(.*?)(?=^#+\s|\Z)", markdown, re.M | re.S)
    return len(re.findall(r"^\s*\d+\.\s", m.group(1), re.M)) if m else 0


def audit_notebook(path: Path) -> Report:
    r = Report(path.stem)
    markdown, code, aliases, origins = [], [], {}, {}
    for index, cell in enumerate(json.loads(path.read_text())["cells"]):
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            markdown.append(src)
            r.figures += len(re.findall(r"!\[[^\]]*\]\(figures/", src)) + src.count('<img src="figures/')
            r.links += len(re.findall(r"\]\(https?://", src))
        elif cell["cell_type"] == "code":
            stripped, english = _code_and_strings(src)
            code.append(stripped)
            defined, launched = _calls(src, aliases)
            r.defined |= defined
            r.launched |= launched
            r.figures += len(re.findall(r"\bfigures\.show\(", src))
            try:
                tree = ast.parse(_python(src)) if not src.lstrip().startswith("%%") else ast.Module([], [])
            except SyntaxError:
                tree = ast.Module([], [])
            _origins(tree, origins)
            r.process_risks += [f"cell {index} line {n.lineno}: {why}: {ast.unparse(n)[:70]}"
                                for n in _top_level(tree) if (why := process_risk(n))]
            if "solution" in cell.get("metadata", {}).get("tags", []):
                r.solutions += 1
                continue  # a solution is the learner's own work: the reading and code budgets leave it out
            r.string_words += sum(len(WORD.findall(s)) for s in english)
            r.code_lines += sum(1 for line in stripped.splitlines() if line.strip())
            calls = _library_calls(tree, origins)
            script = _written_script(src)  # a %%writefile cell's Python: torch on the page that ranks run
            if script is not None:
                script_origins = {}
                _origins(script, script_origins)
                calls = _library_calls(script, script_origins)
            r.helper_calls += calls["helpers"]
            r.torch_calls += calls["torch"]
            r.page_calls += calls["pages"]
            text = src.lstrip().partition("\n")[2] if script is not None else _python(src)  # a script: below %%writefile
            r.longest_function = max([r.longest_function, *_function_lengths(script or tree, text)])
            r.gpu_lines += _gpu_only(tree)
    text = "\n".join(markdown)
    r.words = len(WORD.findall(re.sub(r"```.*?```|`[^`]*`|\(https?://[^)]*\)", " ", text, flags=re.S)))
    r.words += r.string_words
    r.exercises = _exercises(text)
    r.code = "\n".join(code)
    return r


def audit(root: Path = ROOT) -> tuple[list[Report], list[str], dict[str, list[str]]]:
    """(a report per notebook, lessons whose calls are in no cell, {notebook: launched fns no notebook defines})."""
    reports = [audit_notebook(p) for p in sorted((root / "notebooks").glob("*.ipynb"))]
    defined = set().union(*(r.defined for r in reports)) if reports else set()
    missing_lessons = []
    for lesson, (pattern, calls) in LESSONS.items():
        code = "\n".join(r.code for r in reports if re.search(pattern, r.name))
        absent = [c for c in calls if not re.search(r"\b" + re.escape(c) + r"\b", code)]
        if absent:
            missing_lessons.append(f"{lesson}: {', '.join(absent)} in no cell")
    undefined = {}
    for r in reports:
        names = sorted(f for f in r.launched if f.split(".")[-1] not in defined)
        if names:
            undefined[r.name] = names
    return reports, missing_lessons, undefined


# ---- GPU routes per machine class: which cells put work on GPUs with 1, 2, 4 (standing for ≥ 4) and 8 GPUs ----
MACHINES = (1, 2, 4, 8)


def _planners(n: int) -> dict:
    """The course's planners as a notebook names them, told that the machine has ``n`` usable GPUs."""
    from types import SimpleNamespace

    from helpers import devices, stages

    import torch

    from helpers import devices, stages

    def count(n_gpus):  # a call that names its own count ("what if") keeps it
        return n if n_gpus is None else n_gpus

    dev = SimpleNamespace(
        plan=lambda w, n_gpus=None, backend=None: devices.plan(w, n_gpus=count(n_gpus), backend=backend),
        plan_launch=lambda w, n_gpus=None: devices.plan_launch(w, n_gpus=count(n_gpus)), gpu_count=lambda: n,
        pick_device=lambda i=0: torch.device("cuda", i if i < n else 0) if n else torch.device("cpu"))
    stg = SimpleNamespace(plan_pipeline=lambda s=2, n_gpus=None: stages.plan_pipeline(s, n_gpus=count(n_gpus)),
                          plan_hybrid=lambda w=2, s=2, n_gpus=None: stages.plan_hybrid(w, s, n_gpus=count(n_gpus)))
    return {"devices": dev, "stages": stg, "SMOKE": False, "min": min, "max": max, "len": len, "range": range,
            "dict": dict, **vars(dev), **vars(stg)}


def _value(node: ast.AST, ns: dict):
    try:
        expression = ast.fix_missing_locations(ast.Expression(node))
        return eval(compile(expression, "<audit>", "eval"), {"__builtins__": {}}, ns)  # noqa: S307
    except Exception:  # a name the audit cannot know (data, a model): not a planning expression
        return None


def _on_gpu(plan) -> bool:
    found = getattr(plan, "devices", ())
    flat = [d for d in found for d in (d if isinstance(d, tuple) else (d,))]
    return any(getattr(d, "type", None) == "cuda" for d in flat)


def _cell_routes(tree: ast.Module, ns: dict, planners: dict) -> list[str]:
    """Why one cell puts work on a GPU of an ``n``-GPU machine (empty: it does not), updating ``ns`` as it runs."""
    why = []
    for node in tree.body:  # top-level assignments give later cells their world sizes and plans
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], _value(node.value, ns)
            if isinstance(target, ast.Name) and value is not None:
                ns[target.id] = value
            elif isinstance(target, ast.Tuple) and isinstance(value, tuple) and len(value) == len(target.elts):
                ns.update({t.id: v for t, v in zip(target.elts, value) if isinstance(t, ast.Name)})  # W, LR = 2, 0.1
    for node in _top_level(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func).split(".")[-1]
            kw = {}  # keyword → value; **QUIET spreads a dict the notebook assigned, e.g. dict(plan=devices.plan_launch)
            for k in node.keywords:
                value = _value(k.value, ns)
                kw.update(value if k.arg is None and isinstance(value, dict) else {k.arg: value} if k.arg else {})
            if name in LAUNCHERS and len(node.args) >= 2 and isinstance(w := _value(node.args[1], ns), int):
                chosen, backend = kw.get("plan") or planners["plan"], kw.get("backend")
                plan = (chosen(w, backend=backend) if chosen is planners["plan"] else
                        chosen(w) if callable(chosen) else chosen)  # plan_launch, or a Plan given as it is
                if _on_gpu(plan):
                    why.append(f"{name} W={w} ({plan.backend})")
            elif name == "torchrun_command" and isinstance(w := kw.get("nproc"), int):
                if _on_gpu(plan := planners["plan"](w)):  # the course's scripts plan with devices.plan(LOCAL_WORLD_SIZE)
                    why.append(f"torchrun nproc={w} ({plan.backend})")
            else:  # work on a GPU device the notebook chose (01's pick_device): a call given it
                given = [ns.get(a.id) for a in node.args if isinstance(a, ast.Name)] + list(kw.values())
                cuda = [str(d) for d in given if getattr(d, "type", None) == "cuda"]
                if cuda:
                    why.append(f"work on {cuda[0]}")
        elif isinstance(node, ast.If) and (GPU_TEST.search(test := ast.unparse(node.test)) or "plan" in test):
            verdict = _value(node.test, ns)
            if verdict:
                why.append(f"if {test[:40]}")
    return list(dict.fromkeys(why))


def gpu_routes(root: Path = ROOT, machines=MACHINES) -> dict[int, dict[str, list[tuple[int, str]]]]:
    """{GPUs: {notebook: [(cell, why), ...]}}: the cells that put ranks or work on GPUs on such a machine.

    Derived from each notebook's code with the course's own planners told the GPU count: launches
    (``launch(fn, W)``, ``plan=devices.plan_launch``), torchrun's ``nproc``, plan calls whose devices are GPUs,
    ``if`` branches on a GPU test that hold there, and top-level calls given a GPU device the notebook chose
    (``pick_device``). Full size (``SMOKE`` False). Not seen: a world size or test the audit cannot evaluate (it
    depends on data or on torch at run time), launches inside functions (20 starts train_gpt.py from one, sized by
    ``mfu.plan_capstone``), and where a launched rank function puts its work when it plans on its own (11's
    ``pp_rank`` follows ``stages.plan_pipeline``): the launch's plan is what is listed.
    """
    routes = {}
    for n in machines:
        per = {}
        for path in sorted((root / "notebooks").glob("*.ipynb")):
            planners = _planners(n)
            ns = {**planners, "n_gpus": n, "GPUS": n}  # a notebook's own names replace these as its cells assign
            cells = []
            for index, cell in enumerate(json.loads(path.read_text())["cells"]):
                src = "".join(cell["source"])
                if cell["cell_type"] != "code" or src.lstrip().startswith("%%"):
                    continue
                try:
                    tree = ast.parse(_python(src))
                except SyntaxError:
                    continue
                cells += [(index, why) for why in _cell_routes(tree, ns, planners)]
            if cells:
                per[path.stem] = cells
        routes[n] = per
    return routes


def print_gpu_routes(routes: dict) -> None:
    print("\nGPU routes (gpu_routes' docstring says what it cannot see: 21's runs start inside a function)")
    for n, per in routes.items():
        label = f"{n} GPU{'s' if n > 1 else ''}" + (" (and any machine with 4 to 7)" if n == 4 else "")
        print(f"\nGPU routes on {label}: {len(per)} notebooks, {sum(len({c for c, _ in v}) for v in per.values())} cells")
        for name, cells in per.items():
            print(f"  {name}: " + "; ".join(f"cell {c} {why}" for c, why in cells))


TABLE_BEGIN = "<!-- the notebook table: written by `make readme` from each notebook's header -->"
TABLE_END = "<!-- end of the notebook table -->"


def header(path: Path) -> tuple[str, str, str]:
    """(title, runs on, time) from a notebook's first cell: '# NN · Title' and 'Runs on: ... · ~N min'."""
    first = "".join(json.loads(path.read_text())["cells"][0]["source"])
    title = re.search(r"^#\s+(?:\d+\s*·\s*)?(.+)$", first, re.M).group(1).strip()
    runs = re.search(r"^Runs on:\s*(.+?)\s*$", first, re.M).group(1)
    *where, time = [part.strip() for part in runs.split("·")]
    return title, " · ".join(where), time


def readme_table(root: Path = ROOT) -> str:
    rows = ["| notebook | what it teaches | runs on | time (2-core CPU, full size) |", "|---|---|---|---|"]
    for path in sorted((root / "notebooks").glob("*.ipynb")):
        title, where, time = header(path)
        rows.append(f"| [{path.stem}](notebooks/{path.name}) | {title} | {where} | {time} |")
    return f"{TABLE_BEGIN}\n" + "\n".join(rows) + f"\n{TABLE_END}"


def write_readme(root: Path = ROOT) -> None:
    readme = root / "README.md"
    text = readme.read_text()
    start, end = text.index(TABLE_BEGIN), text.index(TABLE_END) + len(TABLE_END)
    readme.write_text(text[:start] + readme_table(root) + text[end:])


def main() -> int:
    if "--readme" in sys.argv:
        write_readme()
        return 0
    reports, missing, undefined = audit()
    print("Solution cells left out of words, code lines and calls. help: calls into the course's machinery; pages: calls"
          " of code a notebook wrote and exported (the ConvNet, the GPT, ...). gpu: lines only a GPU runs (CI never does).")
    print(f"{'notebook':34} {'words':>6} {'in str':>6} {'code':>5} {'help':>5} {'torch':>5} {'pages':>5} {'figs':>4} "
          f"{'links':>5} {'ex':>3} {'sol':>3} {'gpu':>4}  longest function")
    for r in reports:
        print(f"{r.name:34} {r.words:6d} {r.string_share:6.0%} {r.code_lines:5d} {r.helper_calls:5d} "
              f"{r.torch_calls:5d} {r.page_calls:5d} {r.figures:4d} {r.links:5d} {r.exercises:3d} {r.solutions:3d} {len(r.gpu_lines):4d}  "
              f"{r.longest_function[1]} ({r.longest_function[0]})")
    for r in reports:
        if r.gpu_lines:
            print(f"\n{r.name}: the lines only a GPU runs")
            print("\n".join("    " + line for line in r.gpu_lines))
    print_gpu_routes(gpu_routes())
    risks = [f"  {r.name} {risk}" for r in reports for risk in r.process_risks]
    print(f"\ntop-level CUDA or autograd in a notebook's own process: {len(risks)}")
    print("\n".join(risks)) if risks else None
    n = sum(len(v) for v in undefined.values())
    print(f"\nlaunched functions defined in no notebook: {n}")
    for name, fns in undefined.items():
        print(f"  {name}: {', '.join(fns)}")
    print(f"lessons whose torch calls appear in no cell: {len(missing)}")
    for line in missing:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
