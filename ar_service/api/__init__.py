"""The public OpenAI Images API, split the way vLLM's entrypoints are.

``protocol`` holds the request and response models (the wire shapes clients see), ``edit_form``
reads an edit's multipart body into them, ``serving`` translates a request into a generation and
its result into a response, ``router`` binds both to FastAPI routes with authentication and
cancellation.
"""
