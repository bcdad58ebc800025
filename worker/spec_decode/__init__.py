"""Speculative decoding: which requests speculate, how drafts are accepted, the n-gram drafter and the draft
model."""
