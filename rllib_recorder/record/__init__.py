"""What runs inside an RLlib env runner: conversion of what sample() returned, start states, the hand-off to the
spool.
"""
