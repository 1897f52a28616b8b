"""Fixed sleeps under a second that stay in the tests, each with why: time passing is what the test is about
(a client that is slow on purpose, a quiet spell a timer must see out), not a stand-in for "the other side has
done X", which a test waits for instead (tests/support/waiting.py).

Keyed by file, enclosing function and the line's code, not its number: an entry outlives edits around it.
"""

from __future__ import annotations

HEAP = "tests/services/test_heap.py"

ALLOWED: dict[tuple[str, str, str], str] = {
    (
        "tests/ar_service/test_handoff_body.py",
        "test_the_tail_starts_when_the_last_rows_come_out_of_the_engine_not_when_they_are_sent.scenario",
        "await asyncio.sleep(0.02)  # a slow socket",
    ): "a consumer that writes slowly on purpose: stamping the tail when rows are sent would then show",
    (
        "tests/ar_service/test_image_store.py",
        "test_images_expire.scenario",
        "await asyncio.sleep(0.4)",
    ): "twice the 0.2 s time-to-live passes: expiry after that time is what the test is about",
    (
        "tests/dit_service/test_render_scheduler.py",
        "Recorder.render",
        "time.sleep(0.05)",
    ): "the stand-in renderer takes a little time, as a render does: jobs arriving meanwhile queue and batch",
    (
        "tests/dit_service/test_result_stream.py",
        "ScriptedRunner._run",
        "time.sleep(0.5)",
    ): "a denoising step silent for 0.5 s: the progress frames (every 0.1 s) that fill a silence are the case",
    (
        "tests/e2e/test_image_edits.py",
        "test_four_thin_images_at_once_are_400s_before_anything_is_decoded.watch",
        "time.sleep(0.01)",
    ): "a peak meter: the process's RSS sampled every 10 ms while the requests run, not a wait for anything",
    # services/heap.py's IdleRelease is a timer: the schedules of work and quiet are what it is tested on.
    (
        HEAP,
        "test_a_service_gives_its_free_pages_back_once_it_has_been_idle_for_the_delay.one_request_then_quiet",
        "await asyncio.sleep(0.05)",
    ): "a request that lasts 50 ms: the idle delay must count from its end, not its start",
    (
        HEAP,
        "test_work_that_starts_during_the_wait_puts_the_release_off_until_it_is_idle_again.a_request_every_50_ms",
        "await asyncio.sleep(0.01)",
    ): "each request lasts 10 ms: work arriving inside the idle delay is the scenario",
    (
        HEAP,
        "test_work_that_starts_during_the_wait_puts_the_release_off_until_it_is_idle_again.a_request_every_50_ms",
        "await asyncio.sleep(0.04)",
    ): "40 ms of quiet between requests, shorter than the 100 ms delay: each must put the release off",
    (
        HEAP,
        "test_nothing_is_released_while_work_overlaps_and_once_per_idle_spell.overlapping_then_quiet",
        "await asyncio.sleep(0.3)  # three more delays of quiet, in which a second release would come",
    ): "after the first release, quiet in which a second must not come: only time passing can show an absence",
    (
        HEAP,
        "test_a_delay_of_zero_never_releases.one_request_then_quiet",
        "await asyncio.sleep(0.1)",
    ): "quiet in which a delay of 0 must not release: only time passing can show an absence",
    (
        "tests/services/test_slow_readers.py",
        "test_a_slow_client_that_keeps_reading_gets_its_whole_answer",
        "time.sleep(0.01)",
    ): "the client reads slowly on purpose (at most 1.6 MB/s): a slow reader that keeps reading is the case",
}
