"""Speculative decoding: proposers guess the next tokens of a request, and one verify step of
the target model scores them all, keeping the longest prefix its own sampling agrees with and
the token it samples after it.

Host-side proposers (n-gram) run in the engine core after each step and leave their drafts on
the request (Request.spec_token_ids); the scheduler puts them in the next step behind the
request's last token; the model runner scores every draft position and verifies them
(verify.py); the scheduler takes the accepted tokens and rolls the rejected positions back.
"""
