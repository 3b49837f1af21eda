"""Conversation memory (SPEC sections 10 and 14): a call's transcript, its lifecycle and its end.

- :mod:`.messages`: a message's schema, rules, stored encoding and the layouts history is read in;
- :mod:`.requests`: the request bodies (one typed definition each) and who reads a transcript;
- :mod:`.views`: the JSON documents it answers with;
- :mod:`.service`: the use cases (history, summary, context, listing, deletion) over :mod:`.appends`
  (appending) and :mod:`.redaction` (what a message loses before it is stored);
- :mod:`.ending`: the end of a conversation (its state persisted once), :mod:`.lifecycle`: the start and the
  ends the service makes itself, :mod:`.events`: what an end tells its listeners.

Nothing here imports the webhooks: they listen (:mod:`.events`).
"""
