"""daemon/workers/templates.py: chat templates render in bounded worker processes; every
way a render can go wrong is an error for that render only, and the pool goes on."""
from __future__ import annotations

import threading

import pytest

from daemon.workers.templates import KILL_GRACE_S, TemplateWorkers, worker_memory_bytes
from ext.chat_template import ChatTemplateError, ChatTemplateLimitError

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = {"messages": [{"role": "user", "content": "héllo"}], "add_generation_prompt": True}


@pytest.fixture
def pool():
    p = TemplateWorkers(max_chars=10_000, timeout_s=2.0, workers=2)
    yield p
    p.close()


def test_a_render_is_what_jinja_renders_here(pool):
    from ext.chat_template import compile_template, render
    expected = render(compile_template(CHATML), MESSAGES)
    assert pool.render(CHATML, MESSAGES) == expected == (
        "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n")


def test_one_huge_expression_ends_in_the_workers_memory_limit(pool):
    """400 MB in one step: more than the worker's address space, a MemoryError there."""
    assert worker_memory_bytes(pool.max_chars) < 400_000_000
    with pytest.raises(ChatTemplateLimitError, match="more memory"):
        pool.render('{{ "x" * 400000000 }}', {})
    assert pool.render(CHATML, MESSAGES).startswith("<|im_start|>user")   # the pool goes on


def test_a_render_that_never_yields_is_killed_after_its_timeout(pool):
    pool.set_limits(10_000, 0.2)
    with pytest.raises(ChatTemplateLimitError, match=r"longer than 0\.2 s"):
        pool.render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                    "{% endfor %}", {})
    assert pool.killed == 1 and KILL_GRACE_S > 0
    assert pool.render(CHATML, MESSAGES).endswith("assistant\n")        # a new worker


def test_template_errors_and_bad_variables_are_chat_template_errors(pool):
    with pytest.raises(ChatTemplateError, match="no tools") as e:
        pool.render("{{ raise_exception('no tools') }}", {})
    assert not isinstance(e.value, ChatTemplateLimitError)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        pool.render("{% for %}", {})
    with pytest.raises(ChatTemplateError, match="not JSON"):
        pool.render(CHATML, {"messages": [object()]})


def test_renders_run_side_by_side_and_a_closed_pool_refuses(pool):
    results, errors = [], []

    def one(i):
        try:
            results.append(pool.render("{{ n }}", {"n": i}))
        except ChatTemplateError as e:
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and sorted(results, key=int) == [str(i) for i in range(8)]
    pool.close()
    with pytest.raises(ChatTemplateError, match="shutting down"):
        pool.render(CHATML, MESSAGES)


def test_a_worker_slow_to_start_does_not_eat_the_renders_time_limit(tmp_path, monkeypatch):
    """A new worker's interpreter start and imports (slow on a loaded machine) are waited
    for apart: only the render itself counts against chat_template_timeout_s."""
    import sys

    from daemon.workers import templates
    slow = tmp_path / "slow-python"
    startup = 0.2 + KILL_GRACE_S + 0.5       # longer than the render may be waited for
    slow.write_text(f"#!/bin/sh\nsleep {startup}\nexec {sys.executable} \"$@\"\n")
    slow.chmod(0o755)
    monkeypatch.setattr(templates, "WORKER_COMMAND", (str(slow), "-m", "daemon.workers.template_worker"))
    pool = TemplateWorkers(max_chars=10_000, timeout_s=0.2, workers=1)
    try:
        assert pool.render(CHATML, MESSAGES).endswith("assistant\n")
        assert pool.killed == 0
    finally:
        pool.close()


def test_a_worker_that_never_says_ready_is_an_error_for_that_render(monkeypatch):
    from daemon.workers import templates
    monkeypatch.setattr(templates, "STARTUP_S", 0.5)
    monkeypatch.setattr(templates, "WORKER_COMMAND", ("cat",))     # reads stdin, says nothing
    pool = TemplateWorkers(max_chars=10_000, timeout_s=0.2, workers=1)
    try:
        with pytest.raises(ChatTemplateError, match="did not start within 0.5 s"):
            pool.render(CHATML, MESSAGES)
    finally:
        pool.close()
