"""The worker -> frontend counters file: readers parse only a rewritten file."""

from vllm_treespec.observability import StatsFile


def test_stamp_changes_with_every_write_and_only_then(tmp_path):
    path = str(tmp_path / "engine-0.json")
    assert StatsFile.stamp(path) is None and StatsFile.read(path) is None
    stats = StatsFile(path, min_interval_s=3600.0)
    stats.publish(lambda: {"trees": 1})
    first = StatsFile.stamp(path)
    assert first is not None and StatsFile.stamp(path) == first
    assert StatsFile.read(path) == {"trees": 1}
    stats.publish(lambda: {"trees": 2})  # within the interval: not written
    assert StatsFile.stamp(path) == first and StatsFile.read(path) == {"trees": 1}
    stats.publish(lambda: {"trees": 3}, force=True)
    assert StatsFile.stamp(path) != first and StatsFile.read(path) == {"trees": 3}
