"""Speculative decoding: sampling, verification (greedy / lossless rejection sampling), drafting
(parallel P-EAGLE pass or sequential EAGLE-3 passes), acceptance statistics, and the step that
ties them together (`decoder.SpecDecoder`)."""
