"""The status records as the supervisor decodes them: once, into the declared types, with a
named refusal for a line that is no record, and the channel's old tolerance kept (an unknown
field ignored, a wrong-typed one dropped and named)."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from gpuherd import status_records as sr
from gpuherd.status_channel import RECORD_TYPES
from gpuherd.status_records import (Restart, TimelineAttemptEnd, TimelineProc, TimelineStart, decode, from_object,
                                    to_object)


def _line(**fields) -> bytes:
    return orjson.dumps(fields)


def test_each_live_event_decodes_to_its_own_type_and_an_unknown_one_to_the_base():
    rejoined = decode(_line(type="live", rank=1, time=2.0, event="rejoined", generation=1, step=7, source=0,
                            role="newcomer", seconds=0.25))
    assert rejoined == sr.LiveRejoined(rank=1, time=2.0, event="rejoined", generation=1, step=7, source=0,
                                       role="newcomer", seconds=0.25)
    assert isinstance(decode(_line(type="live", event="able", able=True)), sr.LiveAble)
    future = decode(_line(type="live", event="migrated", where="elsewhere"))
    assert type(future) is sr.Live and future.event == "migrated"


def test_an_unknown_field_is_ignored_and_a_wrong_typed_one_dropped_and_named():
    step = decode(_line(type="step", rank=0, time=1.0, step=4, loss="low", new_field={"x": 1}))
    assert isinstance(step, sr.Step) and step.step == 4 and step.loss is None and step.refused == ("loss",)
    assert decode(_line(type="step", rank=0, time=1e300)).refused == ("time",)  # no clock reads that
    assert decode(_line(type="nan", loss="inf", grad_norm=2)).loss == "inf"  # non-finite values come as words
    alive = decode(_line(type="alive", phase=None, collective=None, where_s=None))  # null: not known
    assert (alive.phase, alive.collective, alive.where_s, alive.refused) == ("unknown", False, 0.0, ())


def test_nan_and_spike_share_their_fields_but_match_apart():
    nan, spike = decode(_line(type="nan", step=3, ranks=[0, 1])), decode(_line(type="spike", step=3, metric="loss"))
    assert isinstance(nan, sr.SuspiciousStep) and isinstance(spike, sr.SuspiciousStep)
    assert not isinstance(spike, sr.Nan) and nan.ranks == (0, 1) and spike.metric == "loss"


@pytest.mark.parametrize(("line", "why"), [
    (b"{", sr.Refused.UNREADABLE), (b"3", sr.Refused.NOT_AN_OBJECT), (b'{"step": 1}', sr.Refused.UNKNOWN_TYPE),
    (b'{"type": "timeline", "event": "start"}', sr.Refused.UNKNOWN_TYPE),  # the supervisor's own: not on a pipe
])
def test_what_is_no_record_is_a_named_refusal(line, why):
    refusal = decode(line)
    assert isinstance(refusal, sr.Refusal) and refusal.why is why and str(refusal)


def test_the_supervisors_own_records_decode_where_they_are_asked_for():
    start = decode(_line(type="timeline", event="start", time=5.0, start=2, dataset_s=1.5), supervisor=True)
    assert start == sr.TimelineStart(time=5.0, event="start", start=2, dataset_s=1.5)
    restart = decode(_line(type="restart", attempt=2, excluded_gpus=[3]), supervisor=True)
    assert isinstance(restart, sr.Restart) and restart.excluded_gpus == (3,)


def test_the_writer_accepts_exactly_the_declared_types_each_a_frozen_dataclass():
    assert RECORD_TYPES == tuple(cls.TYPE for cls in sr.STATUS_RECORDS)
    declared = {*sr.STATUS_RECORDS, *sr.LIVE_EVENTS, *sr.SUPERVISOR_RECORDS, *sr.TIMELINE_EVENTS}
    for cls in declared:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls


def test_the_supervisors_records_written_as_their_classes_decode_back_to_the_same_record():
    written = [TimelineStart(time=1.5e9, start=1, dataset_s=None), TimelineProc(time=1.5e9, rank=2, state="T"),
               TimelineAttemptEnd(time=1.5e9, attempt=0, outcome=None, failed_at=None),
               Restart(time=1.5e9, attempt=1, after="worker-exit: rank 1", exit_code=3, excluded_gpus=(0, 3))]
    for record in written:
        obj = to_object(record)
        assert "refused" not in obj and "truncated" not in obj
        assert from_object(orjson.loads(orjson.dumps(obj)), supervisor=True) == record
    assert to_object(written[0]) == {"type": "timeline", "event": "start", "time": 1.5e9, "start": 1,
                                     "dataset_s": None}  # no rank: the start is nobody's
    assert to_object(written[3])["excluded_gpus"] == [0, 3]
