"""The GPU bench's platform client decodes only the SSE events it measures (platform_bench.py)."""

from benchmarks.gpu.platform_bench import _worth_decoding
from contract.protocol import Usage
from gateway.formats import ChunkWriter


def _lines(frames: bytes) -> list[bytes]:
    return [line for line in frames.split(b"\n") if line.startswith(b"data: {")]


def test_after_the_first_text_only_the_usage_and_errors_are_decoded():
    writer = ChunkWriter("completion", "cmpl-1", 0, "m", include_usage=True)
    # Text that looks like the markers: JSON escapes its quotes, so it cannot match them.
    first, later = _lines(writer.delta("Hi") + writer.delta('say "usage":{ and "error"'))
    usage = Usage(request_id="cmpl-1", tenant_id=1, key_id=1, model="m", prompt_tokens=3, completion_tokens=2)
    finish, usage_line = _lines(writer.closing(usage))

    assert _worth_decoding(first, seen_text=False)
    assert not _worth_decoding(later, seen_text=True)
    assert not _worth_decoding(finish, seen_text=True)
    assert _worth_decoding(usage_line, seen_text=True)
    assert _worth_decoding(b'data: {"error":{"message":"worker lost"}}', seen_text=True)


def test_each_level_reads_the_cpu_time_of_every_part_of_the_platform(tmp_path):
    import os
    import time
    import types

    from benchmarks.gpu.platform_bench import Stack

    stack = Stack(types.SimpleNamespace(state_dir=tmp_path, log_dir=None, model_dir=None, port=0, profile="cpu",
                                        worker_engine_args={}))  # fmt: skip
    (tmp_path / "redis").mkdir()
    (tmp_path / "redis" / "redis.pid").write_text(f"{os.getpid()}\n")
    stack.children = [types.SimpleNamespace(name=name, pid=os.getpid()) for name in ("worker", "beat", "web")]
    meter = stack.cpu_meter()
    meter.start()
    spent = time.process_time()
    while time.process_time() - spent < 0.05:  # CPU time of this process, however busy the machine
        pass
    seconds = meter.stop()
    parts = {"web", "worker", "engine core", "client", "redis"}
    assert set(seconds) == parts | {f"{part} wait" for part in parts} | {"steal"}
    assert seconds["client"] > 0 and seconds["redis"] > 0
    assert all(seconds[f"{part} wait"] >= 0 for part in parts)
