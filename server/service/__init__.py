"""The service layer: what every route shares, with no HTTP dialect in it. Checks, permits,
tokenization off the loop, the scheduler call, and domain results (embeddings, scores, token
states) shaped once; routes render them in their own dialect."""
