"""The house keeps itself: tests that fail on what makes the code harder to live in (an import circle among
product modules, a product function too long to hold, a test that sleeps instead of waiting)."""
