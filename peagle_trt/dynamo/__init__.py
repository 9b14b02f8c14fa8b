"""Dynamo workers: see worker.py."""
