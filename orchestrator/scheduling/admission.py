"""When the scheduler admits a new group (`Scheduler` inherits it; the same state, no I/O): within
the bound of (max_off_policy_steps + 1) x batch size of rollouts dispatched but not yet consumed,
within `max_inflight`, fresh enough to be within the staleness bound when its turn comes, and
with `admission = "just_in_time"` only when the trainer's next steps need it in time
(`orchestrator.scheduling.pacing`). In sync mode, one batch of the newest version at a time."""

from __future__ import annotations

from orchestrator.scheduling.messages import Action


class Admission:
    def _waiting_groups(self) -> int:
        return self._waiting

    def _groups_needed(self) -> int:
        """Groups the remaining steps can still consume, minus those already on their way."""
        if self.max_groups is not None and self.next_group_id >= self.max_groups:
            return 0
        remaining_steps = self.max_steps - self.submitted_steps
        return remaining_steps * self.config.batch_groups - self._waiting_groups()

    def _admit(self) -> list[Action]:
        if self.stopping or self.admission_paused is not None:  # min_engines >= 1: none serving pauses too
            return []
        actions: list[Action] = []
        if self.config.mode == "sync":
            # Each step waits for rollouts of the newest version: groups are admitted only while
            # the trainer holds no batch and the newest published version is live, up to one batch.
            if self.batch_step is not None or self.live < self.published:
                return []
            while (self._groups_needed() > 0 and self._waiting_groups() < self.config.batch_groups
                   and self.outstanding + self.n <= self.admission_bound
                   and self.inflight + self.n <= self.config.max_inflight):
                actions += self._new_group()
            return actions
        # The cheapest test first: at max_inflight (most events, in steady state) it ends the loop.
        # The tests are pure, so their order changes no decision.
        while (self.inflight + self.n <= self.config.max_inflight
               and self._groups_needed() > 0
               and self.outstanding + self.n <= self.admission_bound
               and self._fresh_when_consumed()
               and self._needed_in_time()):
            actions += self._new_group()
        return actions

    def _turn(self) -> int:
        """The step a group admitted now would be consumed by (oldest first, a batch at a time)."""
        return self.done_steps - (-(self.outstanding + self.n) // self.batch_size)

    def _needed_in_time(self) -> bool:
        """Just-in-time admission: is a group admitted now needed now, or would it be ready in
        time if it waited for the next version (fresher samples)? Eager: always needed."""
        if self.config.admission == "eager":
            return True
        holding = self.batch_step is not None
        return self.pacer.needed_now(self._turn(), holding=holding,
                                     base=self.batch_step if holding else self.done_steps,
                                     live=self.live, published=self.published)

    def _fresh_when_consumed(self) -> bool:
        """Would a group admitted now still be within the bound when its turn comes? Groups are
        consumed oldest first, a batch at a time, so its step is at most done_steps +
        ceil((outstanding + group_size) / batch_size). While versions go live promptly (live ==
        done_steps) this is the (k + 1) x batch size bound; a lagging activation tightens it."""
        return self.staleness_for(self._turn(), self.live) <= self.k
