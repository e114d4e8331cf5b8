"""docs/tasks.md runs: each named snippet is written out, each config loads and builds its task on
the tiny model's tokenizer, and each task scores completions as the guide says. Also the task
seam's errors: a missing prompt column, a dataset that is not there, an entrypoint that does not
import, each named."""

from __future__ import annotations

import json
import sys

import anyio
import pytest

from orchestrator.config.run import load_config
from orchestrator.errors import ConfigError
from orchestrator.scoring.scorer import REWARD_ERROR, REWARD_TIMEOUT, ScoreFailed, Scorer
from orchestrator.tasks import make_task
from orchestrator.tasks.entrypoint import search_path
from tests.doc_snippets import snippets, write_snippets

pytestmark = [pytest.mark.timeout(300), pytest.mark.light_lane]


@pytest.fixture(autouse=True)
def _fresh_my_task():
    """The guide's `my_task` and examples/my_task are two packages of one name: never reuse one."""
    def forget():
        for name in [m for m in sys.modules if m == "my_task" or m.startswith("my_task.")]:
            del sys.modules[name]
    forget()
    yield
    forget()


@pytest.fixture
def guide(tmp_path, monkeypatch):
    files = write_snippets(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the user's directory leaves with the test
    return files


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def build(path, tiny_model_dir, tokenizer, section="task"):
    config = load_config(path)
    task_config = config.task if section == "task" else config.eval.task_config(config.task)
    return make_task(task_config, str(tiny_model_dir), search_path=search_path(path), tokenizer=tokenizer,
                     where=section)


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_guide_names_every_file_it_promises():
    assert {"my_task/train.jsonl", "my_task/rewards.py", "my-task.toml", "my_task/task.py", "addition.toml",
            "arithmetic.toml", "my-task-eval.toml", "tracked.toml"} <= set(snippets())


async def test_the_dataset_task_of_the_guide_scores_with_every_component(guide, tiny_model_dir, tokenizer):
    task = build(guide["my-task.toml"], tiny_model_dir, tokenizer)
    rows = [json.loads(line) for line in guide["my_task/train.jsonl"].read_text().splitlines()]
    assert task.rows == len(rows)
    prompts = [await task.prompt(i) for i in range(len(rows))]
    assert sorted(p.row["answer"] for p in prompts) == sorted(r["answer"] for r in rows)  # one epoch: each row once
    prompt = prompts[0]
    assert tokenizer.decode(list(prompt.token_ids)).startswith("<|im_start|>user\n" + prompt.row["prompt"])
    good = await task.score(prompt, ids(tokenizer, prompt.row["answer"]))
    assert good == {"reward": 1.0, "digit_share": 1.0, "starts_with_answer": 1.0, "starts_with_digit": 1.0}
    bad = await task.score(prompt, ids(tokenizer, "no digits here"))
    assert bad["reward"] == 0.0 and bad["starts_with_answer"] == 0.0 and bad["starts_with_digit"] == 0.0


async def test_the_task_object_of_the_guide_gives_rows_and_scores(guide, tiny_model_dir, tokenizer):
    task = build(guide["addition.toml"], tiny_model_dir, tokenizer)
    assert task.name == "addition" and task.rows == 200
    first = [await task.prompt(i) for i in range(200)]
    assert len({p.row["prompt"] for p in first}) > 50
    again = await task.prompt(7)
    assert again == first[7]  # deterministic in the index
    p = first[0]
    assert (await task.score(p, ids(tokenizer, p.row["answer"])))["reward"] == 1.0
    assert (await task.score(p, ids(tokenizer, "x")))["reward"] == 0.0


async def test_the_reasoning_gym_config_of_the_guide_scores_gold_answers_1(guide, tiny_model_dir, tokenizer):
    task = build(guide["arithmetic.toml"], tiny_model_dir, tokenizer)
    prompt = await task.prompt(3)
    gold = f"<answer>{prompt.row['answer']}</answer>"
    assert (await task.score(prompt, ids(tokenizer, gold)))["reward"] == 1.0
    assert (await task.score(prompt, ids(tokenizer, "<answer>nonsense</answer>")))["reward"] == 0.0


async def test_the_eval_config_of_the_guide_builds_its_eval_task(guide, tiny_model_dir, tokenizer):
    config = load_config(guide["my-task-eval.toml"])
    assert config.eval.every_steps == 10 and config.eval.samples_per_prompt == 4
    task = build(guide["my-task-eval.toml"], tiny_model_dir, tokenizer, section="eval")
    assert not task.config.shuffle  # the eval set in file order
    assert (await task.prompt(0)).row == json.loads(guide["my_task/train.jsonl"].read_text().splitlines()[0])
    assert load_config(guide["tracked.toml"]).run.wandb_settings().mode == "offline"


def test_a_row_without_the_prompt_column_is_named_at_start(tmp_path, tiny_model_dir, tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n{"question": "b", "answer": "2"}\n')
    config = load_config(_toml(tmp_path, f'dataset = "{data}"\nrewards = [{{fn = "exact"}}]'))
    with pytest.raises(ConfigError) as err:
        make_task(config.task, str(tiny_model_dir), tokenizer=tokenizer)
    assert err.value.field == "task.prompt_field" and "row 1" in str(err.value) and "'prompt'" in str(err.value)


def test_a_dataset_that_is_not_there_is_named(tmp_path, tiny_model_dir, tokenizer):
    config = load_config(_toml(tmp_path, 'dataset = "nowhere/data.jsonl"\nrewards = [{fn = "exact"}]'))
    with pytest.raises(ConfigError) as err:
        make_task(config.task, str(tiny_model_dir), tokenizer=tokenizer)
    assert err.value.field == "task.dataset" and "nowhere/data.jsonl" in str(err.value)


def test_bad_json_names_its_line(tmp_path, tiny_model_dir, tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": oops}\n')
    config = load_config(_toml(tmp_path, f'dataset = "{data}"\nrewards = [{{fn = "exact"}}]'))
    with pytest.raises(ConfigError, match="line 2"):
        make_task(config.task, str(tiny_model_dir), tokenizer=tokenizer)


def test_an_entrypoint_that_does_not_import_is_named(tmp_path, tiny_model_dir, tokenizer):
    config = load_config(_toml(tmp_path, 'entrypoint = "no_such_package.tasks:make"'))
    with pytest.raises(ConfigError) as err:
        make_task(config.task, str(tiny_model_dir), tokenizer=tokenizer)
    assert err.value.field == "task.entrypoint" and "no_such_package" in str(err.value)


def test_a_dataset_without_rewards_is_refused(tmp_path, tiny_model_dir, tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a"}\n')
    config = load_config(_toml(tmp_path, f'dataset = "{data}"'))
    with pytest.raises(ConfigError) as err:
        make_task(config.task, str(tiny_model_dir), tokenizer=tokenizer)
    assert err.value.field == "task.rewards"


@pytest.mark.parametrize("suffix", ["parquet", "csv", "saved"])
async def test_parquet_csv_and_save_to_disk_give_the_same_rows_as_jsonl(tmp_path, tiny_model_dir, tokenizer, suffix):
    import datasets

    rows = [{"prompt": f"Write digits: {i}", "answer": str(i)} for i in range(5)]
    ds = datasets.Dataset.from_list(rows)
    path = tmp_path / ("data" if suffix == "saved" else f"data.{suffix}")
    {"parquet": lambda: ds.to_parquet(str(path)), "csv": lambda: ds.to_csv(str(path), index=False),
     "saved": lambda: ds.save_to_disk(str(path))}[suffix]()
    config = load_config(_toml(tmp_path, f'dataset = "{path}"\nshuffle = false\nrewards = [{{fn = "exact"}}]'))
    task = make_task(config.task, str(tiny_model_dir), tokenizer=tokenizer)
    got = [(await task.prompt(i)).row for i in range(5)]
    assert [str(r["answer"]) for r in got] == [r["answer"] for r in rows]  # CSV infers the numbers as ints
    assert [r["prompt"] for r in got] == [r["prompt"] for r in rows]


async def test_epochs_shuffle_and_skipped_rows(tmp_path, tiny_model_dir, tokenizer):
    data = tmp_path / "d.jsonl"
    long = "word " * 200
    data.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n"
                            for p in ["a", "b", long, "c", "d"]))
    config = load_config(_toml(tmp_path, f'dataset = "{data}"\nepochs = 2\nmax_prompt_tokens = 64\n'
                                         'rewards = [{fn = "exact"}]'))
    task = make_task(config.task, str(tiny_model_dir), tokenizer=tokenizer)
    assert task.rows == 4 and task.skipped == 1
    epoch0 = [(await task.prompt(i)).row["prompt"] for i in range(4)]
    epoch1 = [(await task.prompt(i)).row["prompt"] for i in range(4, 8)]
    assert sorted(epoch0) == sorted(epoch1) == ["a", "b", "c", "d"]
    from orchestrator.tasks import TaskExhausted

    with pytest.raises(TaskExhausted):
        await task.prompt(8)


# wall_clock: the raising reward must be scored as an error within score_timeout_s = 0.5 s.
@pytest.mark.wall_clock
async def test_a_reward_that_raises_or_hangs_is_named_and_bounded(tmp_path, tiny_model_dir, tokenizer):
    (tmp_path / "bad_rewards.py").write_text(
        "import time\n"
        "def boom(completion, **kw):\n    raise RuntimeError('the reward blew up')\n"
        "def slow(completion, **kw):\n    time.sleep(3)\n    return 1.0\n")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a"}\n')
    for fn, kind, words in (("boom", REWARD_ERROR, "the reward blew up"), ("slow", REWARD_TIMEOUT, "score_timeout_s")):
        config = load_config(_toml(tmp_path, f'dataset = "{data}"\nrewards = [{{fn = "bad_rewards:{fn}"}}]'))
        task = make_task(config.task, str(tiny_model_dir), tokenizer=tokenizer, search_path=[str(tmp_path)])
        scorer = Scorer(task, workers=2, timeout_s=0.5)
        prompt = await task.prompt(0)
        with anyio.fail_after(10):
            with pytest.raises(ScoreFailed) as err:
                await scorer.score(prompt, ids(tokenizer, "1"))
        assert err.value.kind == kind and words in err.value.message


def _toml(directory, task_body: str):
    path = directory / "c.toml"
    path.write_text(f"[task]\n{task_body}\n")
    return path


@pytest.mark.parametrize("name", ["my-task.toml", "reasoning-gym.toml", "eval.toml"])
async def test_the_example_configs_build_their_tasks(name, tiny_model_dir, tokenizer, monkeypatch):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the examples name their data relative to the repository root
    path = root / "examples" / name
    task = build(path, tiny_model_dir, tokenizer)
    prompt = await task.prompt(0)
    assert prompt.token_ids and "reward" in await task.score(prompt, ids(tokenizer, "1 2 3"))
    if load_config(path).eval.every_steps:
        eval_task = build(path, tiny_model_dir, tokenizer, section="eval")
        assert (await eval_task.prompt(0)).token_ids


def test_the_readme_task_config_loads(tmp_path):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Your model, your task, your data"):]
    block = re.search(r"```toml\n(.*?)```", section, re.DOTALL).group(1)
    (tmp_path / "readme.toml").write_text(block)
    config = load_config(tmp_path / "readme.toml")
    assert config.task.dataset == "data/train.jsonl" and [r["fn"] for r in config.task.rewards] == [
        "math", "my_task.rewards:format_ok"]
    assert config.eval.every_steps == 10 and config.run.wandb_settings().mode == "offline"


@pytest.mark.parametrize(("task_body", "field", "words"), [
    ('dataset = "missing/train.jsonl"\nrewards = [{fn = "exact"}]', "task.dataset", "missing/train.jsonl"),
    ('dataset = "rows.jsonl"\nrewards = [{fn = "exact"}]', "task.prompt_field", "row 1"),
    ('dataset = "rows.jsonl"\nrewards = [{fn = "nowhere.rewards:f"}]', "task.rewards[0].fn", "nowhere"),
    ('entrypoint = "nowhere.tasks:make"', "task.entrypoint", "nowhere"),
])
def test_inflight_run_stops_at_start_naming_the_task_mistake(tmp_path, tiny_model_dir, task_body, field, words):
    import subprocess

    (tmp_path / "rows.jsonl").write_text('{"prompt": "a"}\n{"question": "b"}\n')
    config = tmp_path / "c.toml"
    config.write_text(f'[engine]\nmodel = "{tiny_model_dir}"\n[run]\nmodel_preset = "tiny"\nprogress = "none"\n'
                      f'[task]\n{task_body}\n')
    out = subprocess.run([sys.executable, "-m", "orchestrator.commands.cli", "run", str(config), "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("inflight: error:")]
    assert len(errors) == 1 and field in errors[0] and words in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert not list((tmp_path / "run").glob("engine-*.log"))  # before any engine started


async def test_a_scoring_worker_copy_reads_no_rows_and_scores_the_same(guide, tiny_model_dir, tokenizer):
    config = load_config(guide["my-task.toml"])
    full = make_task(config.task, str(tiny_model_dir), search_path=search_path(guide["my-task.toml"]),
                     tokenizer=tokenizer)
    worker = make_task(config.task, str(tiny_model_dir), search_path=search_path(guide["my-task.toml"]),
                       tokenizer=tokenizer, scoring_only=True)
    assert worker.rows == 0 and not worker.eligible  # nothing read, nothing tokenized
    prompt = await full.prompt(2)
    completion = ids(tokenizer, prompt.row["answer"] + " and more")
    assert await worker.score(prompt, completion) == await full.score(prompt, completion)


async def test_a_model_without_a_chat_template_needs_chat_template_false(tmp_path, tiny_model_dir, tokenizer):
    import copy

    import msgspec

    from orchestrator.config.run import TaskConfig

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "Write digits: 1 2", "answer": "12"}\n')
    for config in (TaskConfig(), TaskConfig(dataset=str(data), rewards=[{"fn": "exact"}])):
        with pytest.raises(ConfigError) as err:
            make_task(config, str(tiny_model_dir), tokenizer=bare)
        assert err.value.field == "task.chat_template"
        raw = make_task(msgspec.structs.replace(config, chat_template=False), str(tiny_model_dir), tokenizer=bare)
        prompt = await raw.prompt(0)
        assert bare.decode(list(prompt.token_ids)) == prompt.text  # the text as it is, no template


def test_an_answer_column_the_rows_lack_is_named_at_start(tmp_path, tiny_model_dir, tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "solution": "1"}\n')
    config = load_config(_toml(tmp_path, f'dataset = "{data}"\nrewards = [{{fn = "exact"}}]'))
    with pytest.raises(ConfigError) as err:
        make_task(config.task, str(tiny_model_dir), tokenizer=tokenizer)
    assert err.value.field == "task.answer_field" and "'answer'" in str(err.value) and "solution" in str(err.value)
    fixed = load_config(_toml(tmp_path, f'dataset = "{data}"\nanswer_field = "solution"\nrewards = [{{fn = "exact"}}]'))
    assert make_task(fixed.task, str(tiny_model_dir), tokenizer=tokenizer).rows == 1


@pytest.mark.parametrize("task", ['entrypoint = "orchestrator.tasks.toy_env:digits_dialogue"',
                                  'agent = "orchestrator.tasks.toy_agent:digits_agent"\n'
                                  'entrypoint = "orchestrator.tasks.toy_agent:rows"'])
@pytest.mark.parametrize("knob", ["max_prompt_tokens = 64", "score_timeout_s = 5.0", "score_workers = 4",
                                  'score_pool = "thread"'])
def test_a_single_turn_knob_on_a_multi_turn_task_is_refused_naming_it(tmp_path, tiny_model_dir, tokenizer, task, knob):
    """Each did nothing for an environment or an agent (issue #30: a knob takes effect or is refused)."""
    config = load_config(_toml(tmp_path, f"{task}\n{knob}"))
    with pytest.raises(ConfigError) as err:
        make_task(config.task, str(tiny_model_dir), tokenizer=tokenizer)
    assert err.value.field == "task." + knob.split(" ")[0], err.value


def test_a_multi_turn_task_with_the_defaults_builds(tmp_path, tiny_model_dir, tokenizer):
    config = load_config(_toml(tmp_path, 'entrypoint = "orchestrator.tasks.toy_env:digits_dialogue"'))
    assert make_task(config.task, str(tiny_model_dir), tokenizer=tokenizer).name
