"""Speculative decoding: proposers guess the next tokens of a request, and one verify step of
the target model scores them all, keeping the longest prefix its own sampling agrees with and
the token it samples after it.

Proposers run in the worker after each step (worker_proposers.py). Their drafts come back with
the step's output and are left on the request (Request.spec_token_ids); the scheduler puts them
in the next step behind the request's last token; the model runner scores every draft position
and verifies them (verify.py); the scheduler takes the accepted tokens and rolls the rejected
positions back. With drafts made on the device (n-gram) and async scheduling, the next step is
scheduled while this one runs instead: its input token and drafts are placeholders that the
runner fills on the device, and its start counts this step's drafts as accepted until the
runner moves it back by those rejected (input_batch.py), as the scheduler does once it knows.
"""
