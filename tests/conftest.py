"""Shared fixtures: the embedded tiny model and tokenizer, and composed configs; the child processes of the tests
marked `background`, run on the machine's second core while the other tests run; the parsed YAML of config files and
the parsed interpolations, kept for the session."""

from __future__ import annotations

import copy
import functools
import inspect
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import omegaconf.base
import omegaconf.grammar_parser
import pytest
import torch
import yaml
from omegaconf import OmegaConf, _utils
from omegaconf._utils import get_yaml_loader

from SPA_agent.config import compose
from SPA_agent.tiny import tiny_model_dir

#: Tests marked `background(command=...)` are run by a child process (or a few, one after another) that starts when the
#: test loop starts: a thread runs them one after another beside the other tests, on the second core of the 2-core
#: machines this suite runs on, and the marked tests run last, each asserting on its own processes' results (the
#: fixture `background_run`). SPA_TEST_BACKGROUND=0, or one core, runs each test's processes when the test runs.
#: A command that takes `tests` makes one job for all the selected tests marked with it (one interpreter start for
#: several runs: tests/trainer/test_learning.py).
BACKGROUND = (os.cpu_count() or 1) >= 2 and os.environ.get("SPA_TEST_BACKGROUND", "1") != "0"

# --- YAML parsed once per text --------------------------------------------------------------------------------------
#: The objects PyYAML parsed from each YAML text in this session. Hydra reads and parses every file of a config again
#: at each composition (some 20 files, ~0.3 s, half of it in PyYAML's pure-Python parser) and the suite composes
#: thousands of times; the same text parses to the same objects, so a copy of those is what OmegaConf.load builds its
#: config from. Keyed by the whole text: a changed file is parsed again; a text that does not parse is never kept.
_PARSED_YAML: dict[str, object] = {}
_omegaconf_load = OmegaConf.load


def _load_parsing_each_text_once(file_):
    """OmegaConf.load (omegaconf 2.3) with the parse of each text kept; its errors, file name included, unchanged."""
    if isinstance(file_, (str, Path)):
        with open(os.path.abspath(file_), encoding="utf-8") as f:
            return _load_parsing_each_text_once(f)
    if not (hasattr(file_, "read") and hasattr(file_, "seekable") and file_.seekable()):
        return _omegaconf_load(file_)
    start = file_.tell()
    text = file_.read()
    if text not in _PARSED_YAML:
        file_.seek(start)
        _PARSED_YAML[text] = yaml.load(file_, Loader=get_yaml_loader())
    obj = copy.deepcopy(_PARSED_YAML[text])
    if obj is not None and not isinstance(obj, (list, dict, str)):
        raise OSError(f"Invalid loaded object type: {type(obj).__name__}")
    return OmegaConf.create() if obj is None else OmegaConf.create(obj)


OmegaConf.load = staticmethod(_load_parsing_each_text_once)

# --- interpolations parsed once per string ---------------------------------------------------------------------------
#: OmegaConf parses an interpolation such as `${model_path}` with its ANTLR grammar (pure Python) each time the node is
#: read or checked, some hundred times for a composition and its resolution. The parse tree is only read afterwards
#: (its tokens keep their own text), so one tree per (string, rule, mode) serves every read; a string that does not
#: parse raises each time, as before (errors are not cached). test_configs.py + test_experiments.py: 76 -> 65 s of CPU.
_parse_interpolation = functools.lru_cache(maxsize=None)(omegaconf.grammar_parser.parse)
omegaconf.base.parse = _utils.parse = _parse_interpolation

# One intra-op thread beside the background processes: OpenMP threads spinning on a core that another process
# holds made tiny runs 10–20× slower; two threads where nothing runs beside the tests.
torch.set_num_threads(1 if BACKGROUND else 2)


@pytest.fixture
def one_torch_thread():
    """One intra-op thread: on a shared 2-core machine, spinning OpenMP threads made tiny runs 10–20× slower
    (autouse in tests/trainer and tests/runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def call_entry(monkeypatch, capsys):
    """call_entry(module, argv) -> (exit status, stderr): the command line `python -m <module> <argv>` that must
    stop on a user error, run as `module.main()` in this process (no interpreter to start, which costs seconds
    here); the environment variables it sets are undone afterwards. A test using it names the test that starts the
    same entry point as a process."""
    environ = dict(os.environ)

    def call(module, argv: list[str]) -> tuple[int, str]:
        monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
        with pytest.raises(SystemExit) as exit_info:
            module.main()
        return exit_info.value.code, capsys.readouterr().err

    yield call
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture
def advantage_batches(monkeypatch):
    """The PPO batches of this test's runs, each recorded once its advantages and returns are computed."""
    from SPA_agent.trainer.ppo_trainer import PPOTrainer

    batches = []
    real_compute_advantage = PPOTrainer.compute_advantage

    def compute_advantage(self, batch):
        metrics = real_compute_advantage(self, batch)
        batches.append(batch)
        return metrics

    monkeypatch.setattr(PPOTrainer, "compute_advantage", compute_advantage)
    return batches


@pytest.fixture(scope="session")
def tiny_dir():
    """Directory of the embedded tiny model (built once per machine, then cached)."""
    return tiny_model_dir()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir)


LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@pytest.fixture(scope="session")
def llama_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with Llama-3's header/end-of-turn special tokens and a Llama-3-style chat template."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.eos_token = "<|eot_id|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


#: A Qwen3-style template written for the tests (not Qwen's text): ChatML turns; an assistant message's
#: `<think>…</think>` reasoning is dropped unless the message comes after the last user message, where it is
#: rendered as a `<think>\n…\n</think>\n\n` block (an empty one when it has none, if it is the final message);
#: `enable_thinking=False` opens the generation prompt with an empty think block.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="session")
def qwen3_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with `<think>`/`</think>` as single added tokens (reserved, as in Qwen3's vocabulary)
    and the Qwen3-style chat template above."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = QWEN3_TEMPLATE
    return tok


@pytest.fixture
def tiny_config():
    """Factory: compose an entry config on the tiny model, e.g. tiny_config("_2_sokoban", "generator=random")."""

    def make(config_name: str = "_2_sokoban", *overrides: str):
        return compose(config_name, ["model=tiny", *overrides])

    return make


# --- child processes on the second core ------------------------------------------------------------------------------
class BackgroundJob:
    """The child processes of one test marked `background(command=command)`: `command(directory, **parameters)` (the test's
    parametrize arguments) returns the keyword arguments of one process (`args`, and `env`, `cwd`, `timeout` if
    needed) or a list of them, run one after another; `directory` is made for the job (the test's `tmp_path` when
    it runs there). `results` are their CompletedProcess (stdout and stderr as text). A command that takes `tests`
    is called once for all the selected tests marked with it, as `command(directory, tests=[(name, parameters), ...])`
    (each test's function name and parametrize arguments, in the order they run)."""

    def __init__(self, items: list[pytest.Item], directory: Path):
        self.directory = directory
        self.results: list[subprocess.CompletedProcess] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.process: subprocess.Popen | None = None
        self.cancelled = False
        command = background_command(items[0])
        try:
            commands = (command(directory, tests=[(item.originalname, parameters(item)) for item in items])
                        if takes_tests(command) else command(directory, **parameters(items[0])))
        except Exception as error:  # the test fails with it, not the collection
            self.commands, self.error = [], error
        else:
            self.commands = commands if isinstance(commands, list) else [commands]

    def run(self) -> None:
        if self.error is not None:
            self.done.set()
            return
        try:
            for command in self.commands:
                if self.cancelled:
                    return
                kwargs = dict(command)
                args, timeout = kwargs.pop("args"), kwargs.pop("timeout", 600)
                self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                start_new_session=True, **kwargs)
                try:
                    stdout, stderr = self.process.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.kill()
                    self.process.communicate()
                    raise
                self.results.append(subprocess.CompletedProcess(args, self.process.returncode, stdout, stderr))
        except BaseException as error:  # re-raised in the test
            self.error = error
        finally:
            self.done.set()

    def kill(self) -> None:
        self.cancelled = True
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self) -> tuple[list[subprocess.CompletedProcess], Path]:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.results, self.directory


def parameters(item: pytest.Item) -> dict:
    return item.callspec.params if hasattr(item, "callspec") else {}


def background_command(item: pytest.Item):
    return item.get_closest_marker("background").kwargs["command"]


def takes_tests(command) -> bool:
    return "tests" in inspect.signature(command).parameters


def job_key(item: pytest.Item) -> tuple:
    """Tests of one `background` command with the same parameters share one job; all the tests of a command that
    takes `tests` share one."""
    command = background_command(item)
    return (command,) if takes_tests(command) else (command, repr(sorted(parameters(item).items())))


def job_items(items: list[pytest.Item]) -> dict[tuple, list[pytest.Item]]:
    """The tests marked `background` among `items`, by job, in order."""
    jobs: dict[tuple, list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("background"):
            jobs.setdefault(job_key(item), []).append(item)
    return jobs


_BACKGROUND_JOBS = pytest.StashKey[dict]()
_RAN_HERE = pytest.StashKey[dict]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The selected tests marked `background` run last; with BACKGROUND their jobs are made here, in that order
    (`job_key`: which tests share a job)."""
    marked = [item for item in items if item.get_closest_marker("background")]
    if not marked:
        return
    items[:] = [item for item in items if not item.get_closest_marker("background")] + marked
    if BACKGROUND and not config.option.collectonly:
        jobs = {}
        for job_tests in job_items(marked).values():
            directory = config._tmp_path_factory.mktemp(re.sub(r"[^A-Za-z0-9_]+", "-", job_tests[0].name)[:40])
            job = BackgroundJob(job_tests, directory)
            jobs.update((item.nodeid, job) for item in job_tests)
        config.stash[_BACKGROUND_JOBS] = jobs


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    """Starts the jobs' thread; when the loop ends (also on Ctrl-C, or SIGTERM: a CI timeout), a job still running is
    killed with its child processes (each job runs in a session of its own)."""
    jobs = list(dict.fromkeys(session.config.stash.get(_BACKGROUND_JOBS, {}).values()))
    if not jobs:
        return (yield)
    threading.Thread(target=lambda: [job.run() for job in jobs], name="background tests", daemon=True).start()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return (yield)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for job in jobs:
            job.kill()


@pytest.fixture
def background_run(request, tmp_path) -> tuple[list[subprocess.CompletedProcess], Path]:
    """(CompletedProcess of each of this test's `background` processes, the directory they ran in): from the thread
    that started them with the test loop, or run now (SPA_TEST_BACKGROUND=0, one core)."""
    jobs = request.config.stash.setdefault(_BACKGROUND_JOBS, {})
    if request.node.nodeid not in jobs:
        key = job_key(request.node)
        ran_here = request.config.stash.setdefault(_RAN_HERE, {})
        if key not in ran_here:
            ran_here[key] = BackgroundJob(job_items(request.session.items)[key], tmp_path)
            ran_here[key].run()
        jobs[request.node.nodeid] = ran_here[key]
    return jobs[request.node.nodeid].wait()
